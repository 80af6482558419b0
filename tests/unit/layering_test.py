#!/usr/bin/env python3
"""The house's layers, held against the code: every #include "..." of src/, include/, tools/,
bench/ and the testing library (tests/harness/) must point into a folder its layer may include
(docs/architecture.md, "Layers", and each folder's README), and tests/ keeps its shape (unit
tests by src/'s layers, tests/README.md). Fails naming each include that runs the wrong way, and each header
of tools/ or bench/ named as a public header is (bench/store.h beside include/kvstash/store.h:
`#include "store.h"` would say one and mean the other to a reader).

usage: layering_test.py SOURCE_ROOT
"""
import os
import re
import sys

# (layer, the folders it may include besides its own). A layer is the longest prefix of a
# file's path listed here. "include/kvstash/<header>" entries allow single public headers.
PUBLIC = "include/kvstash"
TRANSFER_WORDS = [f"{PUBLIC}/{h}" for h in ("transfer.h", "grant.h", "types.h", "status.h", "memory.h")]
RULES = {
    "include/kvstash": [],
    "src/common": [PUBLIC],
    "src/memory": [PUBLIC, "src/common"],
    # Transports: the data plane's words, never the engine's header, never another transport.
    "src/transport": TRANSFER_WORDS + ["src/common", "src/memory"],
    "src/transport/shm": TRANSFER_WORDS + ["src/common", "src/memory", "src/transport/transport.h",
                                           "src/transport/registry.h"],
    "src/transport/tcp": TRANSFER_WORDS + ["src/common", "src/memory", "src/transport/transport.h",
                                           "src/transport/registry.h"],
    "src/transport/ucx": TRANSFER_WORDS + ["src/common", "src/memory", "src/transport/transport.h",
                                           "src/transport/registry.h"],
    "src/transport/verbs": TRANSFER_WORDS + ["src/common", "src/memory", "src/transport/transport.h",
                                             "src/transport/registry.h"],
    # The engine: the transport interface and the registry, never a transport's own folder.
    "src/engine": [PUBLIC, "src/common", "src/transport/transport.h", "src/transport/registry.h"],
    "src/metadata": [PUBLIC, "src/common"],
    "src/store": [PUBLIC, "src/common", "src/metadata"],
    # kvpeer's handoff records run their scripts in the store's cells
    "src/kvcache": [PUBLIC, "src/common", "src/store/cell_records.h"],
    "src/node": [PUBLIC, "src/common", "src/metadata"],
    # The bindings: the public API (and the token check), nothing internal.
    "src/capi": [PUBLIC, "src/common/system.h"],
    "src/python": [PUBLIC, "src/common/system.h"],
    # The shipped programs alone.
    "tools": [PUBLIC, "src/common", "src/metadata", "src/node"],
    # The testing library (the tests' and kvstash-bench's): processes, credentials, Redis probes,
    # and a transport's recording sink (the interface only).
    "tests/harness": [PUBLIC, "src/common", "src/metadata", "src/transport/transport.h"],
    # bench: the testing library starts its cells; `kvstash-bench tier` measures the NVMe tier's
    # device layer itself (and no more of the node); `kvstash-bench replay` measures against the
    # CLI's replay model.
    "bench": [PUBLIC, "src/common", "src/metadata", "src/kvcache/cuda", "src/node/ssd_device.h", "tests/harness",
              "tools/kvstash/replay_model.h"],
}
# tests/: unit tests by layer, system tests (processes), engines, the GPU model, the testing
# library, fuzz targets. Unit tests of what is not a layer of src/: the CLI's models, the bindings.
TESTS_LAYOUT = {"unit", "system", "engines", "gpu", "harness", "fuzz", "meson.build", "README.md"}
UNIT_BEYOND_SRC = {"tools", "bindings"}
SEARCH = ["include", "src", ""]  # the build's include directories, in order
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def layer_of(path):
    best = None
    for layer in RULES:
        if (path == layer or path.startswith(layer + "/")) and (best is None or len(layer) > len(best)):
            best = layer
    return best


def resolve(root, source, name):
    for base in [os.path.dirname(source)] + SEARCH:
        candidate = os.path.normpath(os.path.join(base, name))
        if os.path.isfile(os.path.join(root, candidate)):
            return candidate
    return None  # generated (kvstash_config.h, builtin_transports.h, lua_scripts.h) or a system header


def allowed(source_layer, target):
    if layer_of(target) == source_layer or target.startswith(source_layer + "/"):
        return True
    return any(target == a or target.startswith(a + "/") for a in RULES[source_layer])


def main():
    root = sys.argv[1]
    wrong, files = [], 0
    for top in ("include", "src", "tools", "bench", "tests/harness"):
        for folder, _, names in os.walk(os.path.join(root, top)):
            for name in sorted(names):
                if not name.endswith((".h", ".cc", ".cu", ".c")):
                    continue
                source = os.path.relpath(os.path.join(folder, name), root)
                layer = layer_of(source)
                if layer is None:
                    wrong.append(f"{source}: in no layer of this test's table (add its folder)")
                    continue
                files += 1
                with open(os.path.join(root, source), errors="replace") as f:
                    for number, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        target = resolve(root, source, m.group(1))
                        if target is not None and not allowed(layer, target):
                            wrong.append(f"{source}:{number}: {layer} may not include {target}")
    # tests/ shaped like src/ (tests/README.md): its folders, and unit tests by src/'s layers.
    for entry in sorted(os.listdir(os.path.join(root, "tests"))):
        if entry not in TESTS_LAYOUT:
            wrong.append(f"tests/{entry}: not one of tests/' folders ({', '.join(sorted(TESTS_LAYOUT))})")
    layers = set(os.listdir(os.path.join(root, "src"))) | UNIT_BEYOND_SRC
    for entry in sorted(os.listdir(os.path.join(root, "tests", "unit"))):
        if os.path.isdir(os.path.join(root, "tests", "unit", entry)) and entry not in layers:
            wrong.append(f"tests/unit/{entry}: names no layer of src/")
    public = set(os.listdir(os.path.join(root, PUBLIC)))
    for top in ("tools", "bench"):
        for folder, _, names in os.walk(os.path.join(root, top)):
            for name in sorted(n for n in names if n.endswith(".h") and n in public):
                wrong.append(f"{os.path.relpath(os.path.join(folder, name), root)}: named as {PUBLIC}/{name}")
    if wrong:
        print("includes that run against the layers (docs/architecture.md):")
        for w in wrong:
            print("  " + w)
        return 1
    print(f"{files} files, every include within its layer's rules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
