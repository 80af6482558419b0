#!/usr/bin/env python3
"""Embeds the metadata plane's Lua scripts (src/metadata/lua/*.lua) in the library.

    embed_lua.py --header OUT.h --source OUT.cc --prelude lua/prelude/call.lua --prelude ... \
        lua/begin_put.lua ...

Writes a header declaring one `std::string_view` per script, `kvstash::metadata::lua::k<Name>`
(`begin_put.lua` -> `kBeginPut`), and `kPrelude`, the prelude's modules (lua/prelude/*.lua)
joined in the order given; and a source defining them. scripts.cc makes of kPrelude and the
bodies one function library (and each body's EVAL text).

The prelude's modules each keep one concern (docs/metadata.md, "The scripts' prelude"). A
module may use only itself and the modules before it, and every module and script says in its
header which modules it uses (`-- Uses     nodes, pages`): this is checked here, so the build
fails when a header no longer says what its code does. `--fix-uses` rewrites those lines.

Each file opens with a header comment (its KEYS, ARGV and what it returns). That comment is
documentation for the reader and is left out of the constant: everything from the first line
that does not start with `--` on is the script, byte for byte, so editing a header comment
changes no script's SHA1. A file without a header comment is an error.

The constants are written as ordinary string literals, one per line of Lua, escaped, so no
Lua text can end them early and the generated code compiles without warnings.
"""

import argparse
import pathlib
import re
import sys


def constant_name(path: pathlib.Path) -> str:
    stem = path.stem
    if not re.fullmatch(r"[a-z][a-z0-9_]*", stem):
        sys.exit(f"embed_lua: {path}: a script's file name must be snake_case (it names a C++ constant)")
    return "k" + "".join(part.capitalize() for part in stem.split("_"))


def lines_of(text: str) -> list:
    """The lines of `text`, each with its "\\n" (str.splitlines would also split at \\r, \\f...)."""
    return re.findall(r"[^\n]*\n|[^\n]+$", text)


def script_text(path: pathlib.Path) -> str:
    text = path.read_text(encoding="utf-8")
    lines = lines_of(text)
    n = 0
    while n < len(lines) and lines[n].startswith("--"):
        n += 1
    if n == 0:
        sys.exit(f"embed_lua: {path}: no header comment (say what KEYS and ARGV are and what it returns)")
    return "".join(lines[n:])


def code_of(text: str) -> str:
    """`text` without its comments and string literals (Lua's short forms, which are all the
    scripts use), so that only code's names remain."""
    out = re.sub(r"--\[\[.*?\]\]", " ", text, flags=re.S)
    out = re.sub(r"'(?:\\.|[^'\\\n])*'|\"(?:\\.|[^\"\\\n])*\"", " ", out)
    return re.sub(r"--[^\n]*", " ", out)


def defined_names(code: str) -> set:
    """The names a module defines at its top level (local functions, globals, locals)."""
    names = set(re.findall(r"^(?:local\s+)?function\s+([A-Za-z_]\w*)", code, flags=re.M))
    for group in re.findall(r"^local\s+([A-Za-z_][\w\s,]*?)\s*(?:=|$)", code, flags=re.M):
        names.update(n.strip() for n in group.split(",") if n.strip())
    return names


def names_used(code: str) -> set:
    """The names `code` refers to that it does not declare itself (as a local, a parameter or
    a loop variable): a field (`x.name`, `x:name`) is not a use."""
    own = set(re.findall(r"\blocal\s+function\s+([A-Za-z_]\w*)", code))
    for group in re.findall(r"\blocal\s+([A-Za-z_][\w\s,]*?)\s*(?:=|\n)", code):
        own.update(n.strip() for n in group.split(",") if n.strip())
    for group in re.findall(r"\bfunction\s*[\w.:]*\s*\(([^)]*)\)", code):
        own.update(n.strip() for n in group.split(",") if n.strip())
    for group in re.findall(r"\bfor\s+([\w\s,]+?)\s+(?:in|=)", code):
        own.update(n.strip() for n in group.split(",") if n.strip())
    # A table constructor's keys ({policy = ...}) are not names either.
    code = re.sub(r"([{,]\s*)[A-Za-z_]\w*(\s*=(?!=))", r"\1\2", code)
    used = set(re.findall(r"(?<![.:\w])([A-Za-z_]\w*)", code))
    return used - own


USES = re.compile(r"^-- Uses +(.*)$", re.M)


def uses_line(modules: list) -> str:
    return "-- Uses     " + (", ".join(modules) if modules else "nothing of the prelude")


def check_uses(prelude: list, scripts: list, fix: bool) -> list:
    """Each module's and script's prelude modules, against its header's Uses line. Returns the
    mismatches (or, with `fix`, rewrites the lines and returns none)."""
    order = [p.stem for p in prelude]
    codes = [code_of(script_text(path)) for path in prelude + scripts]
    defines = {m: defined_names(code) for m, code in zip(order, codes)}
    errors = []
    for i, (path, code) in enumerate(zip(prelude + scripts, codes)):
        text = path.read_text(encoding="utf-8")
        module = i < len(prelude)
        used = names_used(code) - (defines[order[i]] if module else set())
        modules = [m for m in (order[:i] if module else order) if used & defines[m]]
        if module:
            later = sorted(n for n in used if any(n in defines[m] for m in order[i + 1:]))
            if later:
                errors.append(f"{path}: uses {', '.join(later)} of a module declared after it")
        want = uses_line(modules)
        found = USES.search(text)
        if found and found.group(0) == want:
            continue
        if not fix:
            errors.append(f"{path}: its header should say\n  {want}\nbut says\n  "
                          f"{found.group(0) if found else '(no Uses line)'}\n(embed_lua.py --fix-uses rewrites it)")
            continue
        lines = lines_of(text)
        if found:
            text = USES.sub(want, text, count=1)
        else:  # the header's last line
            n = 0
            while n < len(lines) and lines[n].startswith("--"):
                n += 1
            text = "".join(lines[:n]) + want + "\n" + "".join(lines[n:])
        path.write_text(text, encoding="utf-8")
    return errors


def escape(line: str) -> str:
    out = []
    for ch in line:
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "?":
            out.append("\\?")  # no trigraph, whatever -std says
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            # Octal, always three digits, so a following digit cannot join the escape.
            out.extend(f"\\{b:03o}" for b in ch.encode("utf-8"))
    return "".join(out)


def literal(text: str) -> str:
    if not text:
        return '""'
    return "\n".join(f'    "{escape(line)}"' for line in lines_of(text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--header", required=True, type=pathlib.Path)
    parser.add_argument("--source", required=True, type=pathlib.Path)
    parser.add_argument("--prelude", required=True, type=pathlib.Path, action="append",
                        help="a module of the prelude, in order (repeat)")
    parser.add_argument("--fix-uses", action="store_true", help="rewrite the headers' Uses lines")
    parser.add_argument("scripts", nargs="+", type=pathlib.Path)
    args = parser.parse_args()

    names = [constant_name(f) for f in args.scripts]
    if "kPrelude" in names or len(set(names)) != len(names):
        sys.exit("embed_lua: two scripts with one name (or a script named prelude)")
    for module in args.prelude:
        constant_name(module)  # snake_case, as the scripts'
    errors = check_uses(args.prelude, args.scripts, args.fix_uses)
    if errors:
        sys.exit("embed_lua: " + "\n".join(errors))
    files = [args.prelude[0]] + args.scripts
    names = ["kPrelude"] + names
    texts = ["".join(script_text(m) for m in args.prelude)] + [script_text(f) for f in args.scripts]

    generated = "// Generated by src/metadata/embed_lua.py from src/metadata/lua/*.lua: edit those.\n"
    header = [generated, "#pragma once\n\n#include <string_view>\n\nnamespace kvstash::metadata::lua {\n\n"]
    header.append("// The prelude every script starts with, then one body per script (its header comment left out).\n")
    for f, name in zip(files, names):
        header.append(f"extern const std::string_view {name};  // {'the prelude' if name == 'kPrelude' else f.name}\n")
    header.append("\n}  // namespace kvstash::metadata::lua\n")

    source = [generated, f'#include "{args.header.name}"\n\nnamespace kvstash::metadata::lua {{\n']
    for f, name, text in zip(files, names, texts):
        # constinit: constant-initialized, so usable from other files' static initializers.
        where = "the prelude's modules" if name == "kPrelude" else f.name
        source.append(f"\n// {where}\nconstinit const std::string_view {name} =\n{literal(text)};\n")
    source.append("\n}  // namespace kvstash::metadata::lua\n")

    args.header.write_text("".join(header), encoding="utf-8")
    args.source.write_text("".join(source), encoding="utf-8")


if __name__ == "__main__":
    main()
