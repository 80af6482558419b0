"""The cell's scripts' prelude by module (meson test `lua_modules`): embed_lua.py's checks of
the declared order and of each header's Uses line, on the tree and on copies of it made wrong.

- The tree passes: every module uses only itself and modules declared before it, and every
  module's and script's Uses line names the modules its code uses.
- A Uses line that leaves a module out, or names one the code does not use, is refused,
  naming the file and the line it should have; --fix-uses rewrites it so that it passes.
- A module that calls a function of a module declared after it is refused (the joined prelude
  would call a global that is nil when the script runs); a local declared ahead and defined in a
  later module is the one way round.
- The prelude is each module's text after its header, in order: nothing between, nothing lost.

Usage: python3 tests/unit/metadata/lua_modules_test.py SOURCE_ROOT
"""

import os
import pathlib
import re
import shutil
import sys
import tempfile
import unittest

ROOT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")).resolve()
METADATA = ROOT / "src" / "metadata"
sys.path.insert(0, str(METADATA))
import embed_lua  # noqa: E402


def declared():
    """The modules and scripts in the order src/metadata/meson.build lists them."""
    text = (METADATA / "meson.build").read_text()
    modules = [METADATA / m for m in re.findall(r"^  '(lua/prelude/[a-z_]+\.lua)',$", text, flags=re.M)]
    scripts = [METADATA / s for s in re.findall(r"^  '(lua/[a-z_]+\.lua)',$", text, flags=re.M)]
    return modules, scripts


class LuaModules(unittest.TestCase):
    def setUp(self):
        self.modules, self.scripts = declared()
        self.assertGreaterEqual(len(self.modules), 9)
        self.assertGreaterEqual(len(self.scripts), 40)
        self.work = pathlib.Path(tempfile.mkdtemp(prefix="kvstash-lua-modules-"))

    def tearDown(self):
        shutil.rmtree(self.work, ignore_errors=True)

    def copies(self):
        (self.work / "prelude").mkdir()
        modules = [pathlib.Path(shutil.copy(m, self.work / "prelude")) for m in self.modules]
        scripts = [pathlib.Path(shutil.copy(s, self.work)) for s in self.scripts]
        return modules, scripts

    def test_the_tree_passes(self):
        self.assertEqual(embed_lua.check_uses(self.modules, self.scripts, fix=False), [])

    def test_a_stale_uses_line_is_refused_and_fixed(self):
        modules, scripts = self.copies()
        script = next(s for s in scripts if s.name == "commit_put.lua")
        text = script.read_text()
        line = embed_lua.USES.search(text).group(0)
        self.assertIn("publish", line)
        script.write_text(text.replace(line, line.replace(", publish", "")))
        errors = embed_lua.check_uses(modules, scripts, fix=False)
        self.assertEqual(len(errors), 1, errors)
        self.assertIn("commit_put.lua", errors[0])
        self.assertIn(line, errors[0])
        # One that names a module the code does not use is as wrong.
        script.write_text(text.replace(line, line + ", tier"))
        self.assertEqual(len(embed_lua.check_uses(modules, scripts, fix=False)), 1)
        self.assertEqual(embed_lua.check_uses(modules, scripts, fix=True), [])
        self.assertEqual(embed_lua.USES.search(script.read_text()).group(0), line)

    def test_a_module_using_a_later_one_is_refused(self):
        modules, scripts = self.copies()
        pages = next(m for m in modules if m.name == "pages.lua")
        pages.write_text(pages.read_text() + "\nlocal function uses_later(key) return lookup(key) end\n")
        errors = embed_lua.check_uses(modules, scripts, fix=True)
        self.assertTrue(any("pages.lua: uses lookup of a module declared after it" in e for e in errors), errors)

    def test_the_prelude_is_the_modules_in_order(self):
        joined = "".join(embed_lua.script_text(m) for m in self.modules)
        for module in self.modules:
            body = embed_lua.script_text(module)
            self.assertTrue(body.startswith("\n") or module == self.modules[0], module)
            self.assertIn(body, joined)
        # Every top-level definition is in exactly one module, but for a local declared ahead
        # (`local quota_unreserve`) in one module and defined (`function quota_unreserve`) in a
        # later one: the one way a module may call a later one.
        seen, ahead = {}, set()
        for module in self.modules:
            code = embed_lua.code_of(embed_lua.script_text(module))
            for name in embed_lua.defined_names(code):
                if name in ahead and re.search(rf"^function {name}\b", code, flags=re.M):
                    continue
                self.assertNotIn(name, seen, f"{name} defined in {seen.get(name)} and {module.name}")
                seen[name] = module.name
            ahead.update(re.findall(r"^local ([A-Za-z_]\w*)\s*$", code, flags=re.M))
        for name in ("enter", "live", "take_pages", "quota_of", "policy", "release", "evict", "grant_for",
                     "lease_read", "publish", "allocate"):
            self.assertIn(name, seen)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]])
