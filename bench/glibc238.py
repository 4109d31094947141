"""Run llama-cpp-py-sync's prebuilt libraries on a glibc older than 2.38 (Debian 12, Ubuntu 22.04).

Its wheel says manylinux2014 but its libraries were built against glibc 2.38 and need four C23
names of it, ``__isoc23_strtol``/``strtoul``/``strtoull``/``sscanf``, which GCC 13's headers
redirect the classic calls to; they behave as the classic ones except that they also read a
``0b`` prefix. :func:`prepare` makes the package loadable without touching the installed copy:

1. compiles a tiny library defining the four names as the classic calls (needs ``cc``);
2. copies the package to ``WORK/site/`` and marks, in each library copy's ``.gnu.version_r``, the
   need for the version ``GLIBC_2.38`` weak, so the loader no longer refuses libc for lacking it;
3. returns the environment to run Python with: ``LD_PRELOAD`` the small library (its unversioned
   definitions then satisfy the references) and ``PYTHONPATH`` the copy first.

Where the installed package loads as it is, :func:`prepare` returns no change.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

VERSION = b"GLIBC_2.38"
SHT_GNU_VERNEED = 0x6FFFFFFE
VER_FLG_WEAK = 0x2
SHIM_C = """#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
long __isoc23_strtol(const char *s, char **e, int b) { return strtol(s, e, b); }
unsigned long __isoc23_strtoul(const char *s, char **e, int b) { return strtoul(s, e, b); }
unsigned long long __isoc23_strtoull(const char *s, char **e, int b) { return strtoull(s, e, b); }
long long __isoc23_strtoll(const char *s, char **e, int b) { return strtoll(s, e, b); }
int __isoc23_sscanf(const char *s, const char *f, ...) {
    va_list a; va_start(a, f); int r = vsscanf(s, f, a); va_end(a); return r;
}
"""


def loads_as_is() -> bool:
    probe = "from llama_cpp_py_sync._cffi_bindings import get_lib; get_lib()"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def weaken_version_need(path: Path, version: bytes = VERSION) -> int:
    """Mark the need for ``version`` weak in an x86-64 ELF library; returns how many entries changed."""
    data = bytearray(path.read_bytes())
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    # Elf64_Shdr: name, type, flags, addr, offset, size, link, info, addralign, entsize
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    changed = 0
    for sec in sections:
        if sec[1] != SHT_GNU_VERNEED:
            continue
        strtab, need = sections[sec[6]][4], sec[4]
        while True:  # Elf64_Verneed: version, cnt, file, aux, next; then cnt Elf64_Vernaux
            _, count, _, aux, next_need = struct.unpack_from("<HHIII", data, need)
            entry = need + aux
            for _ in range(count):  # Elf64_Vernaux: hash, flags, other, name, next
                _, flags, _, name, next_aux = struct.unpack_from("<IHHII", data, entry)
                start = strtab + name
                if bytes(data[start:data.index(0, start)]) == version:
                    struct.pack_into("<H", data, entry + 4, flags | VER_FLG_WEAK)
                    changed += 1
                entry += next_aux
            if not next_need:
                break
            need += next_need
    if changed:
        path.write_bytes(bytes(data))
    return changed


def prepare(work: Path) -> dict[str, str]:
    """Extra environment variables that make ``import llama_cpp_py_sync`` load its libraries here."""
    if loads_as_is():
        return {}
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp_py_sync")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llama-cpp-py-sync is not installed")
    package = Path(next(iter(spec.submodule_search_locations)))
    site = work / "site"
    copy = site / package.name
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(package, copy)
    for lib in copy.glob("*.so*"):
        weaken_version_need(lib)
    source, shim = work / "isoc23.c", work / "libisoc23.so"
    source.write_text(SHIM_C)
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(shim), str(source)], check=True)
    preload = " ".join(p for p in (str(shim), os.environ.get("LD_PRELOAD", "")) if p)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"LD_PRELOAD": preload, "PYTHONPATH": path}
