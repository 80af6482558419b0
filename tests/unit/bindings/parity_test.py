"""The C API and the Python module against the C++ API they translate (STYLE.md: "One API,
three faces"). The C++ names are read from the public headers (include/kvstash/*.h); the C
names from include/kvstash/c_api.h; the Python names from the built module (pybind11
signatures). What may differ is the table below, and nothing else:

- a C++ field or parameter `x` of type std::chrono::milliseconds is `x_ms`; a `deadline` is
  `timeout_ms` (from now, 0: the store's default) in C and Python;
- enums are C enums whose values are KVSTASH_<C++ value in SNAKE_CASE> (in the C++ order), and
  in Python the same names in lower case, as strings;
- Type::method is kvstash_<type>_<method> in C (the store's methods are kvstash_<method>) and
  Type.method in Python;
- every C++ option field a binding leaves out, every name a binding translates and every name
  only a binding has is listed below, with the reason.

Fails naming each drifted name. Usage: parity_test.py SOURCE_ROOT [PYTHON_MODULE_DIR]
(without the module directory, only the C API is checked, and the output says so).
"""
import ast
import re
import sys
from pathlib import Path

# ---- the table ----------------------------------------------------------------------------

# C++ option structs and what mirrors their fields: the C struct, the Python callable.
#   omit: fields no binding offers (name: reason), per binding ("c"/"py") or for both
#   translate: C++ field -> the binding names that stand for it
#   flatten: field of a nested option struct -> (its struct, the sub-fields the bindings offer)
STRUCTS = [
    dict(cpp="StoreOptions", c="kvstash_store_options", py="Store.__init__",
         flatten={"engine": ("EngineOptions", ["transports", "cluster_token"])},
         omit={"both": {"put_lease": "tuning: the C++ default", "read_lease": "tuning: the C++ default",
                        "put_reservation": "tuning: the C++ default",
                        "avoid_unreachable_nodes": "tuning: the C++ default",
                        "wait_for_pages": "tuning: the C++ default",
                        "commit_replicas": "C++ only so far (Sentinel deployments)",
                        "cells": "C++ only so far (deployments of several cells)",
                        "previous_cells": "C++ only so far (deployments of several cells)",
                        "cell_directory": "C++ only so far (deployments of several cells)",
                        "cell_directory_refresh": "tuning: the C++ default",
                        "redis_timeout": "tuning: the C++ default",
                        "redis_connections": "tuning: the C++ default",
                        "async_threads": "the *_async forms are C++ only",
                        "verify_checksum": "always on for plain objects",
                        "rkey_scope": "the cell's policy (benchmarks and tests override it in C++)"}}),
    dict(cpp="KvCacheShape", c="kvstash_kv_layout", py="KvCache.__init__"),
    dict(cpp="PrefixKeyOptions", c="kvstash_key_options", py="KvCache.__init__",
         omit={"py": {"layout_tag": "KvCache.open sets it from the layout (a scheduler passes it to "
                                    "prefix_chunk_keys)",
                      "layer_count": "KvCache.open sets it from the layout (prefix_chunk_keys takes it)"},
               "c": {f: "keys by heads, of pipeline stages and of hybrid models' groups: C++ and Python (C "
                        "keys by rank, one object a chunk)" for f in ("heads_total", "head_first", "head_count",
                                                                       "layers_total", "layer_first",
                                                                       "layer_count", "group")}}),
    dict(cpp="KvCacheOptions", c="kvstash_kv_layout", py="KvCache.__init__",
         translate={"device": ["staging"], "path": ["staging"]},  # a binding cannot pass a KvDevice
         omit={"both": {"bounce_slots": "tuning: the C++ default"}}),
]

# The KvLayout constructors the bindings offer as `arrangement` (the C enum's values, the
# Python strings); their parameters other than the shape are fields of the C layout struct
# and keywords of KvCache().
LAYOUT_CONSTRUCTORS_OMITTED = {"custom": "strides: C++ only"}

# Classes whose methods the bindings mirror: the C prefix of their functions, the Python class.
#   omit: methods no binding offers; translate: method -> binding names (per binding or both)
CLASSES = [
    dict(cpp="Store", c_prefix="kvstash_", py="Store",
         translate={"open": {"c": ["store_open"], "py": ["__init__"]},
                    "register_memory": {"c": [], "py": ["register_memory"]},  # C: the KV cache registers
                    "connect_nodes": {"c": []}},  # an engine's start: Python's and C++'s so far
         omit={"get_unsized": "it is the bindings' get (they know no size in advance)",
               "begin_put": "C++ only: streamed puts are the KV cache's",
               "stat": "C++ only (the CLI shows it)", "touch": "C++ only",
               "put_async": "C++ only", "get_async": "C++ only", "remove_async": "C++ only",
               "touch_async": "C++ only", "contains_prefix_async": "C++ only",
               "engine": "C++ only",
               "metrics": "C++ only: the bindings read the registry's text (metrics_text)",
               "lease_reads": "C++ only: the KV cache's loads lease their chunks with it",
               "commit_all": "C++ only: the KV cache's saves commit their chunks with it"}),
    dict(cpp="KvCache", c_prefix="kvstash_kvcache_", py="KvCache",
         translate={"open": {"py": ["__init__"]},
                    "keys": {"c": ["key"]},  # C returns no lists: one key per call
                    # C has no default arguments: the forms with a keep are functions of their own
                    "begin_save": {"c": ["begin_save", "begin_save_keep"]},
                    "begin_load_range": {"c": ["begin_load_range", "begin_load_range_keep"]},
                    "objects_per_chunk": {"c": []},  # C keys by rank: one object per chunk
                    "key_options": {"both": ["chunk_tokens", "layout_tag"]}},  # its fields
         omit={"layout": "the bindings describe the layout at open",
               "save": "the one-call form: begin_save, save_layer, wait",
               "load": "the one-call form: begin_load, wait"}),
    # P/D's direct path is Python's (kvstash.vllm) and C++'s so far
    dict(cpp="KvHandoffs", c_prefix="kvstash_handoffs_", py="KvHandoffs",
         translate={**{m: {"c": []} for m in ("publish", "descriptor", "end", "pending")},
                    "KvHandoffs": {"c": [], "py": ["__init__"]}}),
    dict(cpp="KvSave", c_prefix="kvstash_save_", py="KvSave",
         translate={"wait": {"c": ["finish"]},  # waits, and frees the handle
                    "save_layer": {"c": ["layer", "layer_after"]},  # kvstash_save_layer[_after]
                    "keys": {"c": []},  # C names a chunk's key with kvstash_kvcache_key
                    # C saves carry no KV events' data: a C engine announces with kvstash_announce
                    "announced": {"c": []}}),
    dict(cpp="KvLoad", c_prefix="kvstash_load_", py="KvLoad",
         translate={"wait": {"c": ["finish"]},
                    "object_statuses": {"c": []}}),  # C keys by rank: an object a chunk
    # P/D's direct path: no C face yet. Python opens both over a KvCache (its store and layout).
    dict(cpp="KvExport", c_prefix="kvstash_export_", py="KvExport",
         translate={"open": {"c": [], "py": ["__init__"]}, "descriptor": {"c": []}, "fence": {"c": []},
                    "grant": {"c": []}}),
    dict(cpp="KvImport", c_prefix="kvstash_import_", py="KvImport",
         translate={"open": {"c": [], "py": ["__init__"]}, "begin_read": {"c": []}}),
    dict(cpp="KvPeerRead", c_prefix="kvstash_peer_read_", py="KvPeerRead",
         translate={m: {"c": []} for m in ("poll", "wait", "cancel", "bytes")}),
]

# Free functions: C++ name -> binding names.
FUNCTIONS = {"prefix_chunk_keys": {"c": ["kvstash_prefix_chunk_key"],  # one key per call, as above
                                   "py": []},
             # Python's prefix_chunk_keys is both (groups=1: prefix_chunk_keys); C keys by rank.
             "prefix_object_keys": {"c": [], "py": ["prefix_chunk_keys"]}}

# Names only a binding has.
C_ONLY_FUNCTIONS = {
    "kvstash_status_name": "statuses are codes in C",
    "kvstash_last_error": "the message of a status",
    "kvstash_store_close": "C frees handles explicitly", "kvstash_kvcache_close": "ditto",
    "kvstash_save_free": "drops an unfinished save (~KvSave)",
    "kvstash_load_free": "drops an unfinished load (~KvLoad)",
}
C_ONLY_ENUMS = {"kvstash_staging": "KvCacheOptions::path and ::device in one",
                "kvstash_arrangement": "checked against the KvLayout constructors"}
BINDING_ONLY_FIELDS = {"arrangement": "which KvLayout constructor", "store": "the KvCache's store (Python)",
                       "listen": "EngineOptions' tcp.listen and verbs.listen's host, in one (Python)"}
# C parameters that carry what C++ passes as spans and return values.
C_PLUMBING = {"out", "out_size", "capacity", "size", "n", "per_chunk", "count", "chunks", "index", "event",
              "length",
              # kvstash_announce: C++'s (key, data) pairs as three arrays, and what it returns
              "item_keys", "item_data", "item_lengths", "announced",
              # kvstash_kvcache_lookup_prefix: KvLookup's fields
              "keep"}

# What the bindings may include besides include/kvstash/: the cluster-token check (C and Python
# refuse an empty token, which C++ takes as none).
BINDING_INCLUDES = {"common/system.h"}

# C enums and the C++ enums they mirror: (C++ enum, prefix of the C values after KVSTASH_).
ENUMS = {"kvstash_status": ("StatusCode", ""), "kvstash_dtype": ("KvDType", ""),
         "kvstash_block_order": ("KvBlockOrder", ""), "kvstash_memory_kind": ("MemoryKind", "MEMORY_"),
         "kvstash_sync_kind": ("Kind", "SYNC_")}  # KvSync::Kind

# ---- parsing ------------------------------------------------------------------------------


def strip_comments(text):
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif text.startswith("/*", i):
            i = text.find("*/", i) + 2
            out.append(" ")
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def block_after(text, start):
    """The text inside the braces opening at or after `start`, and the index after them."""
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j], j + 1
    raise ValueError("unbalanced braces")


def split_top(text, sep):
    """Splits at `sep` outside (), [], {} and <> (templates)."""
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "([{<":
            depth += 1
        elif c in ")]}>":
            depth -= 1
        if c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def statements(body):
    """The top-level declarations of a class body, and its access specifiers ("public:")."""
    out, cur, depth, i = [], [], 0, 0
    while i < len(body):
        c = body[i]
        cur.append(c)
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
            if c == "}" and depth == 0 and "(" in "".join(cur) and not body[i + 1:].lstrip().startswith(";"):
                out.append("".join(cur).strip())  # an inline function's body ends it
                cur = []
        elif c == ";" and depth == 0:
            out.append("".join(cur)[:-1].strip())
            cur = []
        elif c == ":" and depth == 0 and re.fullmatch(r"\s*(public|private|protected)\s*:", "".join(cur)) \
                and not body.startswith("::", i):
            out.append("".join(cur).strip())
            cur = []
        i += 1
    return out


def without_body(st):
    """A declaration without its inline function body."""
    depth = 0
    for i, c in enumerate(st):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if c == "{" and depth == 0 and re.search(r"(\)|const|override|noexcept)\s*$", st[:i]):
            return st[:i].strip()
    return st


def top_eq(decl):
    """Splits a declaration at its initializer's '=' (outside parentheses)."""
    depth = 0
    for i, c in enumerate(decl):
        depth += {"(": 1, ")": -1, "<": 1, ">": -1}.get(c, 0)
        if c == "=" and depth == 0 and decl[i + 1:i + 2] != "=" and not decl[:i].rstrip().endswith("operator"):
            return decl[:i].strip(), decl[i + 1:].strip()
    return decl.strip(), None


def params_of(text):
    out = []
    for p in split_top(text, ","):
        decl, default = top_eq(p)
        m = re.search(r"(\w+)\s*$", decl)
        if m and m.group(1) not in ("void", "const"):
            out.append(dict(name=m.group(1), type=decl[:m.start()].strip(), default=default))
    return out


class Cpp:
    """Structs (fields), classes (public methods) and enums of the C++ headers."""

    def __init__(self, headers):
        self.structs, self.methods, self.enums, self.functions, self.raw = {}, {}, {}, {}, ""
        self.overloads = set()  # (class, method)
        for h in headers:
            raw = h.read_text()
            self.raw += raw
            text = strip_comments(raw)
            for m in re.finditer(r"\benum\s+class\s+(\w+)\s*(?::\s*[\w:]+)?\s*\{", text):
                body, _ = block_after(text, m.start())
                values, nxt = [], 0
                for v in split_top(body, ","):
                    name, value = top_eq(v)
                    nxt = int(value) if value is not None else nxt
                    values.append((name, nxt))
                    nxt += 1
                self.enums[m.group(1)] = values
            for m in re.finditer(r"\b(struct|class)\s+(\w+)\s*(?:final\s*)?\{", text):
                body, _ = block_after(text, m.start())
                self._record(m.group(1), m.group(2), body)
            depth = 0
            for m in re.finditer(r"[{}]|^[\w:<>,\s]+?\b(\w+)\(([^;{]*)\)\s*;", text, re.M):
                if m.group(0) in "{}":
                    depth += 1 if m.group(0) == "{" else -1
                elif depth == 1 and m.group(1):  # namespace scope
                    self.functions[m.group(1)] = params_of(m.group(2))

    def _record(self, kind, name, body):
        public = kind == "struct"
        fields, methods = [], {}
        for st in statements(body):
            access = re.fullmatch(r"(public|private|protected)\s*:", st)
            if access:
                public = access.group(1) == "public"
                continue
            if not public or re.match(r"(struct|class|friend|using|enum|static_assert|typedef)\b", st):
                continue
            st = re.sub(r"\[\[\w+\]\]|\b(static|virtual|explicit|inline|constexpr)\b", "", st).strip()
            decl, default = top_eq(without_body(st))
            if decl.endswith("}"):  # brace initializer
                decl, default = decl[:decl.index("{")].strip(), decl[decl.index("{") + 1:-1].strip()
            core = re.sub(r"\s*(const|override|noexcept|&&|&)\s*$", "", decl)
            if core.endswith(")"):
                m = re.search(r"(~?\w+)\s*\(", _without_templates(core))
                if m and "operator" not in core and m.group(1) != name and not m.group(1).startswith("~"):
                    if m.group(1) in methods:
                        self.overloads.add((name, m.group(1)))
                    methods[m.group(1)] = params_of(core[m.end():-1])
            else:
                m = re.search(r"(\w+)\s*$", decl)
                fields.append(dict(name=m.group(1), type=decl[:m.start()].strip(), default=default))
        if kind == "struct" or fields:
            self.structs.setdefault(name, fields)
        self.methods.setdefault(name, methods)


def _without_templates(s):
    out, depth = [], 0
    for c in s:
        depth += {"<": 1, ">": -1}.get(c, 0)
        out.append(c if depth == 0 and c != ">" else " ")
    return "".join(out)


class C:
    """Structs, enums and functions of the C header."""

    def __init__(self, header):
        text = strip_comments(header.read_text())
        self.structs, self.enums, self.functions = {}, {}, {}
        for m in re.finditer(r"typedef\s+struct\s+(\w+)\s*\{", text):
            body, _ = block_after(text, m.start())
            names = []
            for decl in body.split(";"):  # `uint32_t a, b;` declares a and b
                names += [re.search(r"(\w+)\s*$", d).group(1) for d in split_top(decl, ",")]
            self.structs[m.group(1)] = names
        for m in re.finditer(r"typedef\s+enum\s+(\w+)\s*\{", text):
            body, _ = block_after(text, m.start())
            self.enums[m.group(1)] = [(n, int(v)) for n, v in (top_eq(e) for e in split_top(body, ","))]
        for m in re.finditer(r"\b(kvstash_\w+)\s*\(([^;{]*?)\)\s*;", text):
            self.functions[m.group(1)] = [p["name"] for p in params_of(m.group(2))]


class Py:
    """Classes (methods, properties, keywords) and functions of the Python module."""

    def __init__(self, module_dir):
        sys.path.insert(0, module_dir)
        import kvstash  # noqa: E402 (the built module)

        self.module = kvstash

    def attrs(self, cls):
        c = getattr(self.module, cls)
        return {n for n in dir(c) if not n.startswith("_")} | {"__init__"}

    def keywords(self, dotted):
        """(name, default or None, has a default) of a function's keywords, from pybind11's
        signature line "name(self: T, a: int, b: str = 'x') -> R"."""
        obj = self.module
        for part in dotted.split("."):
            obj = getattr(obj, part)
        line = (obj.__doc__ or "").strip().splitlines()[0]
        args = line[line.index("(") + 1:line.rindex(")")]
        out = []
        for a in split_top(args.replace("->", "→"), ","):
            name, _, rest = a.partition(":")
            if name.strip() == "self":
                continue
            default = None
            has = "=" in rest
            if has:
                text = rest.split("=", 1)[1].strip()
                try:
                    default = ast.literal_eval(text)
                except (ValueError, SyntaxError):
                    default = text
            out.append((name.strip(), default, has))
        return out


# ---- checks -------------------------------------------------------------------------------


def snake(cpp_value):
    """kNotFound -> NOT_FOUND, kNHD -> NHD, kFloat8E4M3 -> FLOAT8_E4M3."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", cpp_value[1:]).upper()


def binding_name(field):
    if field["name"] == "deadline":
        return "timeout_ms"
    return field["name"] + "_ms" if "chrono::milliseconds" in field["type"] else field["name"]


class Check:
    def __init__(self, root, module_dir):
        inc = Path(root) / "include" / "kvstash"
        self.cpp = Cpp(sorted(p for p in inc.glob("*.h") if p.name != "c_api.h"))
        self.c = C(inc / "c_api.h")
        self.py = Py(module_dir) if module_dir else None
        self.errors = []

    def fail(self, what):
        self.errors.append(what)

    def enum_text(self, cpp_enum, value):
        """How the bindings spell a C++ enum value: the mirroring C value, in lower case."""
        for c_enum, (cpp, prefix) in ENUMS.items():
            if cpp == cpp_enum:
                for (c_name, _), (cpp_name, _) in zip(self.c.enums.get(c_enum, []), self.cpp.enums[cpp]):
                    if cpp_name == value:
                        return c_name[len("KVSTASH_" + prefix):].lower()
        return None

    def cpp_default(self, field):
        d, t = field["default"], field["type"]
        if d is None:
            return "" if t == "std::string" else None
        m = re.fullmatch(r"(\w+)::(k\w+)", d)
        if m:
            return self.enum_text(m.group(1), m.group(2))
        d = re.sub(r"(?<=\d)[uUlL]+$", "", d)
        try:
            return ast.literal_eval({"true": "True", "false": "False"}.get(d, d))
        except (ValueError, SyntaxError):
            return None

    # Enums: the C values are the C++ values, in order.
    def enums(self):
        for c_enum, (cpp_enum, prefix) in ENUMS.items():
            want = [("KVSTASH_" + prefix + snake(n), v) for n, v in self.cpp.enums[cpp_enum]]
            if cpp_enum == "KvDType":  # the dtypes' text forms, as to_string(KvDType) documents them
                names = re.search(r"to_string\(KvDType \w+\);\s*//\s*(.*)", self.cpp.raw).group(1)
                want = [("KVSTASH_" + t.upper(), v) for t, (_, v) in
                        zip(re.findall(r'"(\w+)"', names), self.cpp.enums[cpp_enum])]
            got = self.c.enums.get(c_enum)
            if got != want:
                self.fail(f"C enum {c_enum} is {got}, mirroring {cpp_enum} it would be {want}")
        ctors = [n for n in self.cpp.methods["KvLayout"] if n not in LAYOUT_CONSTRUCTORS_OMITTED
                 and self.cpp.methods["KvLayout"][n] and self.cpp.methods["KvLayout"][n][0]["name"] == "shape"]
        want = [("KVSTASH_" + n.upper(), i) for i, n in enumerate(ctors)]
        if self.c.enums.get("kvstash_arrangement") != want:
            self.fail(f"C enum kvstash_arrangement is {self.c.enums.get('kvstash_arrangement')}, the KvLayout "
                      f"constructors would be {want}")
        for e in self.c.enums:
            if e not in ENUMS and e not in C_ONLY_ENUMS:
                self.fail(f"C enum {e} mirrors no C++ enum (add it to ENUMS or C_ONLY_ENUMS)")

    # Option structs: every C++ field the bindings offer, under its name, and no other.
    def structs(self):
        offered = {}  # binding target -> names the C++ side accounts for
        layout_params = {p["name"] for n, ps in self.cpp.methods["KvLayout"].items()
                         if n not in LAYOUT_CONSTRUCTORS_OMITTED and ps and ps[0]["name"] == "shape"
                         for p in ps[1:]}
        for s in STRUCTS:
            fields = self.cpp.structs[s["cpp"]]
            omit = s.get("omit", {})
            for side, target in (("c", s["c"]), ("py", s["py"])):
                have = self.names_of(side, target)
                if have is None:
                    continue
                skip = {**omit.get("both", {}), **omit.get(side, {})}
                acc = offered.setdefault((side, target), set(BINDING_ONLY_FIELDS))
                if target in ("kvstash_kv_layout", "KvCache.__init__"):
                    acc |= layout_params
                for f in fields:
                    if f["name"] in skip:
                        continue
                    if f["name"] in s.get("flatten", {}):
                        sub_struct, subs = s["flatten"][f["name"]]
                        sub_fields = {x["name"]: x for x in self.cpp.structs[sub_struct]}
                        names = []
                        for sub in subs:
                            if sub not in sub_fields:
                                self.fail(f"{sub_struct} has no field {sub} (STRUCTS flattens it into "
                                          f"{s['cpp']}::{f['name']})")
                            else:
                                names.append(binding_name(sub_fields[sub]))
                    else:
                        names = s.get("translate", {}).get(f["name"], [binding_name(f)])
                    for n in names:
                        acc.add(n)
                        if n not in have:
                            self.fail(f"{self.face(side)} {target} has no `{n}` for {s['cpp']}::{f['name']}")
                        elif side == "py" and f["name"] not in s.get("flatten", {}) and n == binding_name(f):
                            self.check_default(target, n, f)
        for (side, target), acc in offered.items():
            for n in self.names_of(side, target):
                if n not in acc:
                    self.fail(f"{self.face(side)} {target} has `{n}`, which is no C++ field or parameter "
                              f"(a drifted name? else list it in tests/unit/bindings/parity_test.py)")
        for side, target in (("c", "kvstash_kv_layout"), ("py", "KvCache.__init__")):
            have = self.names_of(side, target)
            for p in layout_params:
                if have is not None and p not in have:
                    self.fail(f"{self.face(side)} {target} has no `{p}` (a KvLayout constructor's parameter)")

    def check_default(self, target, name, field):
        want = self.cpp_default(field)
        for n, default, has in self.py.keywords(target):
            if n == name and has and want is not None and default != want:
                self.fail(f"Python {target}({name}={default!r}): the C++ default of {field['name']} is {want!r}")

    def face(self, side):
        return "C" if side == "c" else "Python"

    def names_of(self, side, target):
        if side == "c":
            return set(self.c.structs.get(target, []))
        if self.py is None:
            return None
        return {n for n, _, _ in self.py.keywords(target)}

    # Methods: Type::method is kvstash_<type>_<method> and Type.method, with the same keywords.
    def methods(self):
        c_accounted = set(C_ONLY_FUNCTIONS)
        for cls in CLASSES:
            cpp_methods = self.cpp.methods[cls["cpp"]]
            for c, m in sorted(self.cpp.overloads):
                if c == cls["cpp"]:
                    self.fail(f"C++ {c}::{m} is overloaded: C and Python cannot mirror overloads name for name "
                              f"(give each its own name, as begin_load and begin_load_range)")
            py_attrs = self.py.attrs(cls["py"]) if self.py else None
            py_accounted = {"__init__"}
            for name, params in cpp_methods.items():
                if name in cls.get("omit", {}):
                    continue
                tr = cls.get("translate", {}).get(name, {})
                for side in ("c", "py"):
                    names = tr.get(side, tr.get("both", [name]))
                    for n in names:
                        if side == "c":
                            fn = ("kvstash_" + n) if n.startswith("store_") else cls["c_prefix"] + n
                            c_accounted.add(fn)
                            if fn not in self.c.functions:
                                self.fail(f"C has no {fn} for {cls['cpp']}::{name}")
                            else:
                                self.check_params("C", fn, self.c.functions[fn][1:], params)  # less the handle
                        elif py_attrs is not None:
                            py_accounted.add(n)
                            if n not in py_attrs:
                                self.fail(f"Python {cls['py']} has no `{n}` for {cls['cpp']}::{name}")
                            elif n != "__init__" and callable(getattr(getattr(self.py.module, cls["py"]), n)):
                                kws = [k for k, _, _ in self.py.keywords(f"{cls['py']}.{n}")]
                                self.check_params("Python", f"{cls['py']}.{n}", kws, params)
            if py_attrs is not None:
                for a in py_attrs - py_accounted:
                    self.fail(f"Python {cls['py']}.{a} mirrors no method of {cls['cpp']} "
                              f"(a drifted name? else list it in tests/unit/bindings/parity_test.py)")
        for name, faces in FUNCTIONS.items():
            params = self.cpp.functions.get(name)
            if params is None:
                self.fail(f"the C++ headers declare no function {name}")
                continue
            for fn in faces["c"]:
                c_accounted.add(fn)
                if fn not in self.c.functions:
                    self.fail(f"C has no {fn} for {name}")
                else:
                    self.check_params("C", fn, self.c.functions[fn], params)
            for fn in faces["py"] if self.py else []:
                if not hasattr(self.py.module, fn):
                    self.fail(f"Python has no {fn} for {name}")
                else:
                    self.check_params("Python", fn, [k for k, _, _ in self.py.keywords(fn)], params)
        for fn in self.c.functions:
            if fn not in c_accounted:
                self.fail(f"C {fn} mirrors no C++ method (a drifted name? else list it in tests/unit/bindings/parity_test.py)")
        # A handle that finish frees can be dropped unfinished too.
        for fn in self.c.functions:
            if fn.endswith("_finish") and fn[:-len("_finish")] + "_free" not in self.c.functions:
                self.fail(f"C has {fn} but no {fn[:-len('_finish')]}_free")

    def check_params(self, face, fn, names, cpp_params):
        """Each binding parameter is a C++ parameter (an option struct's field for a struct,
        timeout_ms for a deadline), C's spans and results aside."""
        allowed = set()
        for p in cpp_params:
            allowed.add(binding_name(p))
            allowed.add("n_" + p["name"])
            struct = re.sub(r"^const\s+|\s*&$", "", p["type"])
            for f in self.cpp.structs.get(struct, []):
                allowed.add(binding_name(f))
            if p["name"] == "deadline" and "timeout_ms" not in names:
                self.fail(f"{face} {fn} takes no timeout_ms for the C++ deadline")
        for n in names:
            if face == "C" and n in C_PLUMBING:  # spans and results
                continue
            if n not in allowed:
                self.fail(f"{face} {fn} has parameter `{n}`, which is no C++ parameter of it "
                          f"({', '.join(p['name'] for p in cpp_params)})")

    # The bindings are the public API's translations: they include include/kvstash/ (and the
    # cluster-token check), not the layers under it.
    def includes(self, root):
        for f in sorted(p for d in ("capi", "python") for p in (Path(root) / "src" / d).glob("*.cc")):
            for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read_text(), re.M):
                if not inc.startswith("kvstash/") and inc not in BINDING_INCLUDES:
                    self.fail(f"{f.relative_to(root)} includes \"{inc}\": the bindings use include/kvstash/ only")

    def run(self, root):
        self.includes(root)
        self.enums()
        self.structs()
        self.methods()
        return self.errors


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__)
        return 2
    module_dir = sys.argv[2] if len(sys.argv) == 3 else None
    errors = Check(sys.argv[1], module_dir).run(sys.argv[1])
    for e in errors:
        print("DRIFT:", e)
    if not module_dir:
        print("the Python module was not built: only the C API was checked")
    if errors:
        print(f"{len(errors)} names drifted from the C++ API")
        return 1
    print("OK: the C API" + (" and the Python module mirror" if module_dir else " mirrors") + " the C++ API")
    return 0


if __name__ == "__main__":
    sys.exit(main())
