#!/usr/bin/env bash
# The C kernels under AddressSanitizer and UndefinedBehaviorSanitizer (issue 24 §3).
#
# Builds kernels.c the way the wheel does (setup.py build_ext) but with
# -fsanitize=address,undefined -fno-sanitize-recover=all, into a copy of this checkout, then runs
# the kernel tests against that build with libasan preloaded (the Python interpreter itself is not
# instrumented; every kernel call is; pytest captures at sys level so that a report reaches stderr). Any out-of-bounds read or write, use after free, signed
# overflow, misaligned access or other undefined behaviour in kernels.c aborts the run. A positive
# control first checks that the sanitizer is armed: a deliberately overlong call must be caught.
#
# Usage: tests/sanitize_kernels.sh [pytest arguments]
#   PYTHON: the interpreter (default: .venv/bin/python, else python3); CC: the compiler (default cc).
# Documented in docs/reliability.md (Sanitizers). About 4 minutes (2 shared cores), so CI does not run
# it: run it after any change to kernels.c or to the ctypes calls.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python="python3"; fi
fi
cc="${CC:-cc}"
libasan="$("$cc" -print-file-name=libasan.so)"
if [[ "$libasan" != /* || ! -e "$libasan" ]]; then
    echo "sanitize_kernels: $cc has no libasan.so (install the compiler's sanitizer runtime)" >&2
    exit 2
fi
work="$(mktemp -d "${TMPDIR:-/tmp}/sanitize-kernels.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# The checkout as it is (tracked and new files, nothing ignored: no installed _kernels*.so).
(cd "$root" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar -cf - --ignore-failed-read) \
    | tar -xf - -C "$work"
flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1"
(cd "$work" && CC="$cc" CFLAGS="$flags" LDFLAGS="-fsanitize=address,undefined" \
    "$python" setup.py -q build_ext --inplace >"$work/build.log" 2>&1) || { cat "$work/build.log" >&2; exit 1; }
built=("$work"/statefulset/index/_kernels*.so)
if [[ ! -e "${built[0]}" ]]; then
    cat "$work/build.log" >&2
    echo "sanitize_kernels: setup.py built no statefulset/index/_kernels*.so" >&2
    exit 1
fi

export LD_PRELOAD="$libasan"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:alloc_dealloc_mismatch=0:detect_odr_violation=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export PYTHONPATH="$work" PYTHONDONTWRITEBYTECODE=1
cd "$work"

# Positive control: sf_feistel told its input holds 4096 values when it holds 2 reads past the end.
control="$("$python" - <<'PY' 2>&1 || true
import sys, types
package = types.ModuleType("statefulset")
package.__path__ = ["statefulset"]
sys.modules["statefulset"] = package
import numpy
from statefulset.index import compiled
lib = compiled.library()
assert lib is not None and compiled.origin().name.startswith("_kernels"), (compiled.origin(), compiled.reason())
lib.sf_feistel.argtypes = None
x, out = numpy.zeros(2, dtype=numpy.int64), numpy.zeros(4096, dtype=numpy.int64)
keys = numpy.zeros(6, dtype=numpy.uint64)
import ctypes
lib.sf_feistel(ctypes.c_void_p(x.ctypes.data), ctypes.c_int64(4096), ctypes.c_int64(10), ctypes.c_int32(2),
               ctypes.c_void_p(keys.ctypes.data), ctypes.c_int32(6), ctypes.c_int32(0), ctypes.c_void_p(out.ctypes.data))
print("NOT CAUGHT")
PY
)"
if [[ "$control" != *"ERROR: AddressSanitizer: heap-buffer-overflow"* ]]; then
    echo "$control" >&2
    echo "sanitize_kernels: the positive control was not caught: AddressSanitizer is not armed" >&2
    exit 1
fi
echo "sanitize_kernels: positive control caught (heap-buffer-overflow); running the kernel tests under ASan+UBSan"

"$python" -m pytest -q -p no:cacheprovider -x --capture=sys \
    tests/test_kernels.py tests/test_kernels_safety.py tests/test_bestfit.py tests/test_permutation.py "$@"
