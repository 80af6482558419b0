"""The console scripts `kvstashd` and `kvstash` of an installed wheel: each runs the program of
its name that the wheel carries inside this package (kvstash/bin), with the same arguments, in
this process's place."""

import os
import sys


def _run(name: str) -> None:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", name)
    if not os.access(path, os.X_OK):
        sys.exit(f"{name}: this installation of kvstash does not carry it ({path} is missing): install "
                 f"the kvstash wheel (scripts/wheel makes it), or build from source (scripts/setup)")
    os.execv(path, [name, *sys.argv[1:]])


def kvstashd() -> None:
    _run("kvstashd")


def kvstash() -> None:
    _run("kvstash")
