"""A launcher of our own for a compiled Triton kernel whose arguments are all fixed but its pointers.

Triton's C launcher parses every argument of the kernel on every call (pointers, runtime scalars, and the
constexprs, which it then drops) plus a dozen of its own, and goes through ``cuLaunchKernelEx``. A
:class:`~convserve.kernels._launch.LaunchPlan` knows all of them but the tensors' addresses when it is built, so
:func:`native_launcher` packs the kernel's parameter block once per plan, in the layout the compiled kernel
reads (its non-constexpr parameters in order, then Triton's global and profile scratch pointers, NULL here), and
each call only writes the addresses into a copy of it and calls ``cuLaunchKernel``.

The C part (``_C_SOURCE``) is compiled on first use with the system's C compiler into
``$CONVSERVE_CACHE_DIR`` (default ``~/.cache/convserve``), keyed by its source and the Python ABI, and loaded from
there afterwards. It is used only where its parameter layout was checked on a GPU (``TESTED_TRITON``: the Triton
whose compiled kernels the GPU tests ran through it); anywhere else, without a compiler or without a CUDA
driver, or with ``CONVSERVE_NATIVE_LAUNCH=0``, :func:`native_launcher` returns None and plans keep Triton's own
launcher.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Optional

#: Triton versions (prefixes) whose kernels' parameter layout the GPU tests checked through this launcher
TESTED_TRITON = ("3.6.",)

_C_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

/* cuLaunchKernel's signature, without cuda.h (CUresult is an int enum; handles are pointers) */
typedef int (*launch_fn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                         unsigned shared, void *stream, void **params, void **extra);

#define MAX_SLOTS 128
#define MAX_PTRS 32

typedef struct {
    void *function;
    unsigned grid[3], block, shared;
    int n_slots, n_ptrs;
    int ptr_slot[MAX_PTRS];    /* the parameter each call's i-th address fills */
    uint64_t slot[MAX_SLOTS];  /* each parameter's bytes, in the low bytes of its slot (little-endian) */
} plan_t;

static launch_fn cu_launch = NULL;

/* the recorder (tests without a GPU): the last launch's arguments and parameter bytes */
static plan_t rec;
static void *rec_stream = NULL;
static int record_launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                         unsigned shared, void *stream, void **params, void **extra) {
    rec.function = f; rec.grid[0] = gx; rec.grid[1] = gy; rec.grid[2] = gz; rec.block = bx; rec.shared = shared;
    rec_stream = stream;
    (void)by; (void)bz; (void)extra;
    for (int i = 0; i < rec.n_slots; i++) memcpy(&rec.slot[i], params[i], 8);
    return 0;
}

static void free_plan(PyObject *cap) { PyMem_Free(PyCapsule_GetPointer(cap, "convserve.plan")); }

static PyObject *init_driver(PyObject *self, PyObject *noargs) {
    if (cu_launch == NULL || cu_launch == record_launch) {
        void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (lib == NULL) lib = dlopen("libcuda.so.1", RTLD_NOW);
        if (lib == NULL) Py_RETURN_FALSE;
        cu_launch = (launch_fn)dlsym(lib, "cuLaunchKernel");
    }
    return PyBool_FromLong(cu_launch != NULL);
}

static PyObject *use_recorder(PyObject *self, PyObject *noargs) {
    cu_launch = record_launch;
    Py_RETURN_NONE;
}

/* make(function, gx, gy, gz, block, shared, slots: bytes (8 per parameter), ptr_slots: bytes (int32 each)) */
static PyObject *make(PyObject *self, PyObject *args) {
    unsigned long long function;
    unsigned gx, gy, gz, block, shared;
    Py_buffer slots, ptrs;
    if (!PyArg_ParseTuple(args, "KIIIIIy*y*", &function, &gx, &gy, &gz, &block, &shared, &slots, &ptrs))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t n_slots = slots.len / 8, n_ptrs = ptrs.len / 4;
    if (slots.len % 8 || ptrs.len % 4 || n_slots > MAX_SLOTS || n_ptrs > MAX_PTRS) {
        PyErr_SetString(PyExc_ValueError, "too many parameters for one plan");
        goto done;
    }
    plan_t *p = PyMem_Calloc(1, sizeof(plan_t));
    if (p == NULL) { PyErr_NoMemory(); goto done; }
    p->function = (void *)(uintptr_t)function;
    p->grid[0] = gx; p->grid[1] = gy; p->grid[2] = gz; p->block = block; p->shared = shared;
    p->n_slots = (int)n_slots; p->n_ptrs = (int)n_ptrs;
    memcpy(p->slot, slots.buf, slots.len);
    memcpy(p->ptr_slot, ptrs.buf, ptrs.len);
    for (int i = 0; i < p->n_ptrs; i++) {
        if (p->ptr_slot[i] < 0 || p->ptr_slot[i] >= p->n_slots) {
            PyMem_Free(p);
            PyErr_SetString(PyExc_ValueError, "pointer slot out of range");
            goto done;
        }
    }
    out = PyCapsule_New(p, "convserve.plan", free_plan);
    if (out == NULL) PyMem_Free(p);
done:
    PyBuffer_Release(&slots);
    PyBuffer_Release(&ptrs);
    return out;
}

/* launch(plan, stream, address, ...): the plan's parameters with these addresses, on this stream */
static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2) { PyErr_SetString(PyExc_TypeError, "launch(plan, stream, *addresses)"); return NULL; }
    plan_t *p = (plan_t *)PyCapsule_GetPointer(args[0], "convserve.plan");
    if (p == NULL) return NULL;
    if (nargs != 2 + p->n_ptrs) {
        PyErr_Format(PyExc_TypeError, "this plan takes %d addresses, got %zd", p->n_ptrs, nargs - 2);
        return NULL;
    }
    if (cu_launch == NULL) { PyErr_SetString(PyExc_RuntimeError, "no CUDA driver"); return NULL; }
    uint64_t slot[MAX_SLOTS];
    void *params[MAX_SLOTS];
    memcpy(slot, p->slot, (size_t)p->n_slots * 8);
    void *stream = PyLong_AsVoidPtr(args[1]);
    if (stream == NULL && PyErr_Occurred()) return NULL;
    for (int i = 0; i < p->n_ptrs; i++) {
        unsigned long long v = PyLong_AsUnsignedLongLong(args[2 + i]);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
        slot[p->ptr_slot[i]] = v;
    }
    for (int i = 0; i < p->n_slots; i++) params[i] = &slot[i];
    int rc;
    if (cu_launch == record_launch) rec.n_slots = p->n_slots;
    /* the driver call can wait for room in the launch queue: other threads (an HTTP loop) run meanwhile */
    Py_BEGIN_ALLOW_THREADS
    rc = cu_launch(p->function, p->grid[0], p->grid[1], p->grid[2], p->block, 1, 1, p->shared, stream, params,
                   NULL);
    Py_END_ALLOW_THREADS
    if (rc != 0) { PyErr_Format(PyExc_RuntimeError, "cuLaunchKernel failed with CUresult %d", rc); return NULL; }
    Py_RETURN_NONE;
}

/* last(): (function, (gx, gy, gz), block, shared, stream, parameter bytes) of the recorder's last launch */
static PyObject *last(PyObject *self, PyObject *noargs) {
    return Py_BuildValue("K(III)IIKy#", (unsigned long long)(uintptr_t)rec.function, rec.grid[0], rec.grid[1],
                         rec.grid[2], rec.block, rec.shared, (unsigned long long)(uintptr_t)rec_stream,
                         (const char *)rec.slot, (Py_ssize_t)rec.n_slots * 8);
}

static PyMethodDef methods[] = {
    {"init_driver", init_driver, METH_NOARGS, "load cuLaunchKernel from libcuda; False when there is none"},
    {"use_recorder", use_recorder, METH_NOARGS, "record launches instead of making them (tests)"},
    {"make", make, METH_VARARGS, "a plan's capsule"},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "launch a plan with these addresses"},
    {"last", last, METH_NOARGS, "the recorder's last launch"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cvlaunch", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cvlaunch(void) { return PyModule_Create(&module); }
"""

_lock = threading.Lock()
_state: dict = {}


def cache_dir() -> Path:
    return Path(os.environ.get("CONVSERVE_CACHE_DIR") or Path.home() / ".cache" / "convserve")


def load_module():
    """The compiled C module (built on first use; cached per source and Python ABI), or None when there is no
    C compiler or the build fails."""
    with _lock:
        if "module" in _state:
            return _state["module"]
        _state["module"] = mod = _build()
        return mod


def _build():
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = hashlib.sha256((_C_SOURCE + sys.version).encode()).hexdigest()[:16]
    so = cache_dir() / f"_cvlaunch_{key}{suffix}"
    if not so.exists():
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
        if cc is None:
            return None
        src = so.parent / f".{so.stem}.{os.getpid()}.c"
        tmp = so.parent / f".{so.stem}.{os.getpid()}{suffix}"
        try:
            so.parent.mkdir(parents=True, exist_ok=True)
            src.write_text(_C_SOURCE)
            subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(src),
                            "-I" + sysconfig.get_paths()["include"], "-ldl"],
                           check=True, capture_output=True, timeout=120)
            os.replace(tmp, so)            # atomic: a concurrent build of the same source wins or loses whole
        except (OSError, subprocess.SubprocessError):
            return None
        finally:
            for f in (src, tmp):
                try:
                    f.unlink()
                except OSError:
                    pass
    try:
        spec = importlib.util.spec_from_file_location("_cvlaunch", so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except (ImportError, OSError):
        return None
    return mod


def enabled() -> bool:
    """Whether plans may launch through this module: a tested Triton, not switched off, the module built and the
    CUDA driver loaded."""
    if "enabled" not in _state:
        ok = os.environ.get("CONVSERVE_NATIVE_LAUNCH", "1") != "0"
        if ok:
            import triton

            ok = triton.__version__.startswith(TESTED_TRITON)
        mod = load_module() if ok else None
        _state["enabled"] = bool(mod is not None and mod.init_driver())
    return _state["enabled"]


_PACK = {"i1": "<b", "i8": "<b", "i16": "<h", "i32": "<i", "i64": "<q", "u1": "<B", "u8": "<B", "u16": "<H",
         "u32": "<I", "u64": "<Q", "fp32": "<f", "f32": "<f", "fp64": "<d"}


def pack_parameters(types: list, values: list, n_ptrs: int) -> Optional[tuple]:
    """``(slots, ptr_slots)`` for :func:`make`: ``types`` is the kernel's signature type of each argument in
    order (``"constexpr"`` for one the compiled kernel does not take), ``values`` the argument values, of which the
    first ``n_ptrs`` are the tensors (filled per call). Each taken argument gets one 8-byte slot; two NULL slots
    follow for Triton's scratch pointers. None for an argument type this launcher does not pack."""
    slots, ptr_slots = [], []
    for i, (ty, v) in enumerate(zip(types, values)):
        if ty == "constexpr":
            if i < n_ptrs:
                return None                # a tensor folded into the kernel: not a layout this packs
            continue
        if i < n_ptrs:
            if not ty.startswith("*"):
                return None
            ptr_slots.append(len(slots))
            slots.append(b"\0" * 8)
            continue
        fmt = _PACK.get(ty)
        if fmt is None or isinstance(v, bool) and fmt[1] in "fd":
            return None
        try:
            raw = struct.pack(fmt, v)
        except struct.error:
            return None
        slots.append(raw.ljust(8, b"\0"))
    slots += [b"\0" * 8, b"\0" * 8]        # global and profile scratch: none (plans with scratch are not raw)
    return b"".join(slots), struct.pack(f"<{len(ptr_slots)}i", *ptr_slots)


def native_launcher(compiled, fn, grid, n_ptrs: int, tail: tuple):
    """``(launch, plan capsule)`` for a compiled kernel launched as ``fn[grid](*tensors, *tail)`` with
    ``n_ptrs`` tensors, or None where this launcher does not apply (see the module docstring)."""
    if not enabled():
        return None
    try:
        sig = compiled.src.signature
        meta = compiled.metadata
        if getattr(meta, "num_ctas", 1) != 1 or tuple(getattr(meta, "cluster_dims", (1, 1, 1)) or (1, 1, 1)) \
                != (1, 1, 1):
            return None
        types = [sig[p.name] for p in fn.params]
        values = [None] * n_ptrs + list(tail)
        if len(types) != len(values) or not all(isinstance(t, str) for t in types):
            return None
        packed = pack_parameters(types, values, n_ptrs)
        if packed is None:
            return None
        mod = load_module()
        g = (tuple(grid) + (1, 1))[:3]
        cap = mod.make(int(compiled.function), int(g[0]), int(g[1]), int(g[2]), 32 * int(meta.num_warps),
                       int(meta.shared), *packed)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    return mod.launch, cap
