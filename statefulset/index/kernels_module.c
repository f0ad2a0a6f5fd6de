/*
 * The Python face of the installed kernels library: an empty module, so that the file the wheel
 * carries (statefulset/index/_kernels.<abi>.so) is an ordinary extension module that anything
 * walking the package may import. The functions themselves are plain C in kernels.c, linked into
 * the same file and called through ctypes (statefulset/index/compiled.py).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef sf_kernels_module = {
    PyModuleDef_HEAD_INIT,
    "_kernels",
    "The compiled kernels of kernels.c; statefulset.index.compiled loads this file with ctypes.",
    -1,
    NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&sf_kernels_module); }
