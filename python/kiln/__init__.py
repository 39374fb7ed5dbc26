"""kiln: Python binding (ctypes) over libkiln.

    import kiln
    with kiln.Model("model.gguf") as m:
        print(m.generate("The capital of France is", max_tokens=16))
        for piece in m.stream("Once upon a time", max_tokens=32):
            print(piece, end="", flush=True)
        print(m.chat([{"role": "user", "content": "Hi!"}], max_tokens=32))

The library is found through $KILN_LIB (a path to libkiln.so: an explicit override), else
libkiln.so inside this package (what `pip install ./python` puts there), else
$KILN_BUILD_DIR/libkiln.so, else <repo>/build/libkiln.so. Every failing call raises KilnError
with kiln's own message; KilnPoisoned, KilnPanic and KilnThreadError are the KilnErrors of a
poisoned device backend, of an invariant broken inside kiln, and of a handle used from a thread
it does not belong to (docs/API.md, "Safe handles").
"""
import codecs
import contextlib
import ctypes as C
import numbers
import os
import queue
import threading
import weakref
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

__version__ = "0.1.0"  # the package's, pyproject.toml's and kiln_version()'s (test_package.py)

__all__ = ["__version__", "KilnError", "KilnPoisoned", "KilnPanic", "KilnThreadError", "backend_poisoned", "Model", "Context", "Tokenizer", "Trainer", "Teacher", "LinearCrossEntropy",
           "load_library"]

_lib = None


def __getattr__(name):
    """kiln.torch (the torch interop, python/kiln/torch.py) is imported on first use, so that
    `import kiln` does not need torch."""
    if name == "torch":
        import importlib
        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")


class KilnError(RuntimeError):
    def __init__(self, status, message):
        super().__init__(f"{message} (status {status})")
        self.status = status
        self.message = message


# kiln.h's statuses that have an exception of their own
KILN_ERR_BAD_HANDLE, KILN_ERR_POISONED, KILN_ERR_PANIC = 10, 11, 12


class KilnPoisoned(KilnError):
    """KILN_ERR_POISONED: a device failure (a GPU fault) poisoned the backend of the Context,
    Trainer or LinearCrossEntropy the call was made on. That handle is closed before this is
    raised (its backend refuses all work); make a new one, which gets a fresh backend. Other
    handles on the same device and arithmetic share the backend and are closed the same way
    on their next call."""


class KilnPanic(KilnError):
    """KILN_ERR_PANIC: an invariant broken inside kiln, caught at the API boundary (a handle's
    memory overwritten, say). The handle is dropped without being freed (freeing damaged
    memory would make things worse); please report it."""


class KilnThreadError(KilnError):
    """A Context or Trainer used from a thread other than the one that made it."""


_STATUS_ERRORS = {KILN_ERR_POISONED: KilnPoisoned, KILN_ERR_PANIC: KilnPanic}
_tls = threading.local()  # .last: a weak reference to the handle whose pointer this thread read last


def _find_library() -> str:
    """The libkiln.so to load: $KILN_LIB, the package's own copy, $KILN_BUILD_DIR, <repo>/build.
    KILN_LIB names one file, so it wins even over an installed package's library (a test of a
    sanitizer build, say); KILN_BUILD_DIR only says where a checkout's build is, and an
    installed package's own library comes before it."""
    if os.environ.get("KILN_LIB"):
        return os.environ["KILN_LIB"]
    bundled = Path(__file__).resolve().parent / "libkiln.so"
    if bundled.exists():
        return str(bundled)
    build = os.environ.get("KILN_BUILD_DIR") or str(Path(__file__).resolve().parents[2] / "build")
    return os.path.join(build, "libkiln.so")


class _ModelParams(C.Structure):
    _fields_ = [("n_threads", C.c_int), ("weight_mode", C.c_int), ("use_mmap", C.c_int)]


class _ContextParams(C.Structure):
    _fields_ = [("n_ctx", C.c_int), ("n_batch", C.c_int), ("n_threads", C.c_int),
                ("fast_q8_activations", C.c_int), ("device", C.c_int),
                ("fast", C.c_int), ("n_seq", C.c_int), ("batch_invariant", C.c_int),
                ("format", C.c_int), ("format_rules", C.c_char_p)]

# kiln_format: the matrix products' number format (Context(format=...))
FORMATS = {"f32": 0, "mx16": 1, "mx8": 2}


def _format_spec(spec):
    """"DEFAULT[,SELECTOR=FORMAT]...": (the default's kiln_format, the rules as bytes or None).
    A spec that starts with a rule has default f32; the library checks the rules against the
    model (docs/ARITHMETIC.md, "Formats per weight")."""
    if not isinstance(spec, str):
        raise TypeError(f"format must be a str, not {type(spec).__name__}")
    head, _, rest = spec.partition(",")
    if "=" in head:
        return FORMATS["f32"], spec.encode()
    if head not in FORMATS:
        raise ValueError(f"format {head!r}: expected one of {', '.join(FORMATS)} (then optional SELECTOR=FORMAT "
                         f"rules, comma-separated)")
    return FORMATS[head], (rest.encode() if rest else None)


class _SamplerParams(C.Structure):
    _fields_ = [("temperature", C.c_float), ("top_k", C.c_int), ("top_p", C.c_float),
                ("min_p", C.c_float), ("repeat_penalty", C.c_float), ("repeat_last_n", C.c_int),
                ("seed", C.c_uint64)]


_TokenCallback = C.CFUNCTYPE(C.c_int, C.c_int32, C.POINTER(C.c_char), C.c_size_t, C.c_void_p)


class _GenerateParams(C.Structure):
    _fields_ = [("max_tokens", C.c_int), ("sampler", _SamplerParams),
                ("stop_strings", C.POINTER(C.c_char_p)), ("ignore_eos", C.c_int),
                ("on_token", _TokenCallback), ("user", C.c_void_p),
                ("logits_chain", C.c_void_p)]


class _GenerateResult(C.Structure):
    # text is a void pointer, read with string_at(text, text_len): generated text may hold NUL
    # bytes (a token can stand for "\x00"), where a c_char_p would end the copy early.
    _fields_ = [("ids", C.POINTER(C.c_int32)), ("n_ids", C.c_size_t), ("text", C.c_void_p),
                ("text_len", C.c_size_t), ("stop_reason", C.c_char_p),
                ("prefill_seconds", C.c_double), ("decode_seconds", C.c_double),
                ("n_prompt", C.c_int), ("n_prompt_cached", C.c_int)]


class _ChatMessage(C.Structure):
    _fields_ = [("role", C.c_char_p), ("content", C.c_char_p)]


class _ModelInfo(C.Structure):
    _fields_ = [("architecture", C.c_char_p), ("name", C.c_char_p),
                ("n_layer", C.c_int), ("n_embd", C.c_int), ("n_head", C.c_int),
                ("n_head_kv", C.c_int), ("head_dim", C.c_int), ("n_ff", C.c_int),
                ("n_vocab", C.c_int), ("n_ctx_train", C.c_int),
                ("rms_norm_eps", C.c_float), ("rope_theta", C.c_float),
                ("tied_embeddings", C.c_int), ("attn_bias", C.c_int), ("qk_norm", C.c_int),
                ("n_params", C.c_uint64), ("weight_bytes", C.c_uint64), ("n_tensors", C.c_int)]


class _TrainParams(C.Structure):
    _fields_ = [("max_seq", C.c_int), ("n_threads", C.c_int), ("ce_chunk", C.c_int),
                ("lr", C.c_double), ("beta1", C.c_double), ("beta2", C.c_double),
                ("eps", C.c_double), ("weight_decay", C.c_double),
                ("weight_storage", C.c_int), ("moment_storage", C.c_int), ("seed", C.c_uint64),
                ("device", C.c_int), ("fast", C.c_int), ("max_batch", C.c_int),
                ("ce_keep_mib", C.c_int), ("ce_row_block", C.c_int), ("ce_logits_f32", C.c_int),
                ("n_extra", C.c_int), ("extra", C.c_void_p), ("format", C.c_int),
                ("format_rounding", C.c_int), ("format_rules", C.c_char_p)]


class _TrainExtra(C.Structure):
    _fields_ = [("name", C.c_char_p), ("rows", C.c_int64), ("cols", C.c_int64)]


class _HiddenPair(C.Structure):
    _fields_ = [("student_layer", C.c_int), ("teacher_layer", C.c_int)]


class _TeacherParams(C.Structure):
    _fields_ = [("n_hidden", C.c_int), ("hidden", C.c_void_p), ("hidden_loss", C.c_int)]


HIDDEN_LOSSES = {"mse": 0, "cosine": 1}
HIDDEN_PROJ_NAME = "distill.hidden.{}.proj"


def hidden_projections(teacher, student, n_pairs):
    """The trainer extras (Trainer(extra=...)) that n_pairs hidden-state pairs between the two
    models need: one (teacher width x student width) projection a pair when the widths differ,
    none when they are equal."""
    ct, cs = teacher.info["n_embd"], student.info["n_embd"]
    return [] if ct == cs else [(HIDDEN_PROJ_NAME.format(k), ct, cs) for k in range(n_pairs)]


class TrainMemory(C.Structure):
    _fields_ = [("params", C.c_uint64), ("grads", C.c_uint64), ("optimizer", C.c_uint64),
                ("activations", C.c_uint64), ("scratch", C.c_uint64), ("peak_step", C.c_uint64),
                ("device", C.c_int)]


class _DistillParams(C.Structure):
    _fields_ = [("temperature", C.c_float), ("kd_weight", C.c_float), ("ce_weight", C.c_float),
                ("hidden_weight", C.c_float)]


class _DistillLoss(C.Structure):
    _fields_ = [("loss", C.c_float), ("kl", C.c_float), ("ce", C.c_float), ("n_supervised", C.c_int64),
                ("hidden", C.c_float)]


class _LinearCEParams(C.Structure):
    _fields_ = [("N", C.c_int64), ("H", C.c_int64), ("V", C.c_int64),
                ("hidden", C.c_void_p), ("weight", C.c_void_p), ("weight_bf16", C.c_int),
                ("targets", C.c_void_p), ("mask", C.c_void_p), ("reduction", C.c_int),
                ("scale", C.c_float), ("dhidden", C.c_void_p), ("dhidden_accumulate", C.c_int),
                ("dweight", C.c_void_p), ("row_loss", C.c_void_p), ("chunk", C.c_int64),
                ("row_block", C.c_int64), ("hidden_stride", C.c_int64), ("hidden_bf16", C.c_int)]


class _LinearCEResult(C.Structure):
    _fields_ = [("loss", C.c_float), ("loss_f64", C.c_double), ("n_supervised", C.c_int64),
                ("scratch_bytes", C.c_size_t)]


class MemStats(C.Structure):
    _fields_ = [("live_bytes", C.c_size_t), ("peak_bytes", C.c_size_t),
                ("live_blocks", C.c_size_t), ("n_allocs", C.c_uint64)]


# safe handles (docs/API.md): status queries and the test hook that poisons a CPU context
_SAFETY_SIGS = {
    "kiln_backend_poisoned": (C.c_int, []),
    "kiln_context_status": (C.c_int, [C.c_void_p]),
    "kiln_trainer_status": (C.c_int, [C.c_void_p]),
    "kiln_linear_ce_status": (C.c_int, [C.c_void_p]),
    "kiln_debug_poison_context": (C.c_int, [C.c_void_p]),
}


def load_library(path=None):
    global _lib
    if _lib is not None and path is None:
        return _lib
    lib = C.CDLL(path or _find_library())
    P = C.c_void_p
    sigs = {
        "kiln_last_error": (C.c_char_p, []),
        "kiln_status_string": (C.c_char_p, [C.c_int]),
        "kiln_model_default_params": (_ModelParams, []),
        "kiln_model_open": (C.c_int, [C.c_char_p, C.POINTER(_ModelParams), C.POINTER(P)]),
        "kiln_model_close": (None, [P]),
        "kiln_model_get_info": (C.c_int, [P, C.POINTER(_ModelInfo)]),
        "kiln_model_get_tokenizer": (P, [P]),
        "kiln_tokenizer_open": (C.c_int, [C.c_char_p, C.POINTER(P)]),
        "kiln_tokenizer_close": (None, [P]),
        "kiln_tokenize": (C.c_int, [P, C.c_char_p, C.c_size_t, C.c_int, C.c_int,
                                    C.POINTER(C.c_int32), C.c_size_t, C.POINTER(C.c_size_t)]),
        "kiln_detokenize": (C.c_int, [P, C.POINTER(C.c_int32), C.c_size_t, C.c_int, C.c_char_p,
                                      C.c_size_t, C.POINTER(C.c_size_t)]),
        "kiln_token_piece": (C.c_char_p, [P, C.c_int32]),
        "kiln_chat_apply": (C.c_int, [P, C.POINTER(_ChatMessage), C.c_size_t, C.c_int,
                                      C.c_char_p, C.c_size_t, C.POINTER(C.c_size_t)]),
        "kiln_context_default_params": (_ContextParams, []),
        "kiln_context_create": (C.c_int, [P, C.POINTER(_ContextParams), C.POINTER(P)]),
        "kiln_context_free": (None, [P]),
        "kiln_context_truncate": (C.c_int, [P, C.c_int]),
        "kiln_context_n_past": (C.c_int, [P]),
        "kiln_decode": (C.c_int, [P, C.POINTER(C.c_int32), C.c_int, C.c_int, C.POINTER(C.c_float)]),
        "kiln_decode_seq": (C.c_int, [P, C.c_int, C.POINTER(C.c_int32), C.c_int, C.c_int,
                                      C.POINTER(C.c_float)]),
        "kiln_decode_batch": (C.c_int, [P, C.POINTER(C.c_int32), C.c_int, C.POINTER(C.c_float)]),
        "kiln_context_seq_n_past": (C.c_int, [P, C.c_int]),
        "kiln_sampler_default_params": (_SamplerParams, []),
        "kiln_generate_default_params": (_GenerateParams, []),
        "kiln_generate": (C.c_int, [P, C.POINTER(C.c_int32), C.c_size_t,
                                    C.POINTER(_GenerateParams), C.POINTER(_GenerateResult)]),
        "kiln_generate_result_free": (None, [C.POINTER(_GenerateResult)]),
        "kiln_model_fingerprint": (C.c_int, [P, C.c_char_p]),
        "kiln_tokenizer_fingerprint": (C.c_int, [P, C.c_char_p]),
        "kiln_train_fingerprint": (C.c_int, [P, C.c_char_p]),
        "kiln_mem_get_stats": (None, [C.POINTER(MemStats)]),
        "kiln_train_default_params": (_TrainParams, []),
        "kiln_trainer_create": (C.c_int, [P, C.POINTER(_TrainParams), C.POINTER(P)]),
        "kiln_trainer_free": (None, [P]),
        "kiln_train_forward": (C.c_int, [P, C.POINTER(C.c_int32), C.c_int, C.POINTER(C.c_int32),
                                         C.c_int, C.c_float, C.POINTER(C.c_float)]),
        "kiln_train_forward_batch": (C.c_int, [P, C.POINTER(C.c_int32), C.c_int, C.c_int,
                                               C.POINTER(C.c_int32), C.c_int, C.c_float,
                                               C.POINTER(C.c_float)]),
        "kiln_train_step_batch": (C.c_int, [P, C.POINTER(C.c_int32), C.c_int, C.c_int,
                                            C.POINTER(C.c_int32), C.c_int, C.c_float, C.c_int,
                                            C.POINTER(C.c_float)]),
        "kiln_train_forward_hidden": (C.c_int, [P, C.POINTER(C.c_int32), C.c_int,
                                                C.POINTER(C.c_int32), C.c_int, C.POINTER(C.c_float)]),
        "kiln_train_backward": (C.c_int, [P, C.POINTER(C.c_float), C.c_int]),
        "kiln_train_discard": (C.c_int, [P]),
        "kiln_teacher_create": (C.c_int, [P, P, C.POINTER(P)]),
        "kiln_teacher_create_ex": (C.c_int, [P, P, P, C.POINTER(P)]),
        "kiln_teacher_free": (None, [P]),
        "kiln_distill_default_params": (_DistillParams, []),
        "kiln_train_distill_step": (C.c_int, [P, P, C.POINTER(C.c_int32), C.c_int, C.c_int,
                                              C.POINTER(C.c_int32), C.POINTER(_DistillParams),
                                              C.c_int, C.c_float, C.c_int,
                                              C.POINTER(_DistillLoss)]),
        "kiln_train_step": (C.c_int, [P, C.POINTER(C.c_int32), C.c_int, C.POINTER(C.c_float)]),
        "kiln_train_grad_sq_norm": (C.c_int, [P, C.POINTER(C.c_double)]),
        "kiln_train_clip_grads": (C.c_int, [P, C.c_double, C.POINTER(C.c_float), C.POINTER(C.c_float)]),
        "kiln_train_optimizer_step": (C.c_int, [P, C.c_double]),
        "kiln_train_n_params": (C.c_int, [P]),
        "kiln_train_param_info": (C.c_int, [P, C.c_int, C.POINTER(C.c_char_p), C.POINTER(C.c_int64),
                                            C.POINTER(C.c_int64)]),
        "kiln_train_get_param": (C.c_int, [P, C.c_char_p, C.POINTER(C.c_float), C.c_int64]),
        "kiln_train_set_param": (C.c_int, [P, C.c_char_p, C.POINTER(C.c_float), C.c_int64]),
        "kiln_train_get_grad": (C.c_int, [P, C.c_char_p, C.POINTER(C.c_float), C.c_int64]),
        "kiln_train_describe": (C.c_int, [P, C.c_char_p, C.c_size_t, C.POINTER(TrainMemory)]),
        "kiln_train_set_params": (C.c_int, [P, C.c_int, C.POINTER(C.c_char_p),
                                            C.POINTER(C.POINTER(C.c_float)), C.POINTER(C.c_int64)]),
        "kiln_train_param_file_shape": (C.c_int, [P, C.c_int, C.POINTER(C.c_int), C.POINTER(C.c_int64)]),
        "kiln_train_clip_coef": (C.c_int, [P, C.c_double, C.POINTER(C.c_float), C.POINTER(C.c_float)]),
        "kiln_train_adamw_step": (C.c_int, [P, C.c_double, C.POINTER(C.c_double), C.c_double]),
        "kiln_train_get_moments": (C.c_int, [P, C.c_char_p, C.POINTER(C.c_float), C.POINTER(C.c_float),
                                             C.c_int64, C.POINTER(C.c_int64)]),
        "kiln_train_set_moments": (C.c_int, [P, C.c_char_p, C.POINTER(C.c_float), C.POINTER(C.c_float),
                                             C.c_int64]),
        "kiln_train_set_optimizer_step_count": (C.c_int, [P, C.c_int64]),
        "kiln_train_save": (C.c_int, [P, C.c_char_p, C.c_uint64, C.c_char_p, C.c_int]),
        "kiln_train_load": (C.c_int, [P, C.c_char_p, C.POINTER(C.c_uint64), C.POINTER(C.c_void_p)]),
        "kiln_string_free": (None, [C.c_void_p]),
        "kiln_linear_ce_default_params": (_LinearCEParams, []),
        "kiln_linear_ce_create": (C.c_int, [C.c_int, C.c_int, C.POINTER(P)]),
        "kiln_linear_ce_free": (None, [P]),
        "kiln_linear_ce_compute": (C.c_int, [P, C.POINTER(_LinearCEParams),
                                             C.POINTER(_LinearCEResult)]),
    }
    sigs.update(_SAFETY_SIGS)
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    lib = _Library(lib, sigs)
    if path is None:
        _lib = lib
    return lib


# Handles on one device share a backend (its thread pool, scratch and weight caches), which
# serves one thread at a time (include/kiln.h). A stream's worker thread and the caller's own
# calls, or a torch backward thread, would otherwise drive it at once: every call that may run
# on a backend holds this lock (reentrant: a token callback runs on the calling thread).
_backend_lock = threading.RLock()
_BACKEND_CALLS = ("kiln_context_", "kiln_decode", "kiln_generate", "kiln_train", "kiln_teacher_",
                  "kiln_linear_ce_", "kiln_model_close", "kiln_backend")


def _locked(fn):
    def call(*args):
        with _backend_lock:
            return fn(*args)
    call.__name__ = getattr(fn, "__name__", "kiln_call")
    return call


class _Library:
    """The loaded library: its declared functions, those that may run on a backend called under
    _backend_lock; any other attribute is the CDLL's own."""

    def __init__(self, cdll, sigs):
        self._cdll = cdll
        for name in sigs:
            fn = getattr(cdll, name)
            setattr(self, name, _locked(fn) if name.startswith(_BACKEND_CALLS) else fn)

    def __getattr__(self, name):
        return getattr(self._cdll, name)


def _check(st):
    if st != 0:
        lib = load_library()
        message = lib.kiln_last_error().decode("utf-8", "replace")
        # the handle of the failed call: the last one whose pointer this thread passed to C
        # (every method reads self._h in the call's arguments, so it is that call's)
        ref, _tls.last = getattr(_tls, "last", None), None
        h = ref() if ref is not None else None
        if h is not None and st == KILN_ERR_POISONED and h._free in _Handle._BACKEND_FREES:
            h.close()
        elif h is not None and st == KILN_ERR_PANIC:
            h._raw = None  # dropped, never freed
        raise _STATUS_ERRORS.get(st, KilnError)(st, message)


def backend_poisoned() -> int:
    """How many device backends a device failure has poisoned that handles still hold
    (kiln_backend_poisoned); 0 when none."""
    return load_library().kiln_backend_poisoned()


def mem_stats():
    s = MemStats()
    load_library().kiln_mem_get_stats(C.byref(s))
    return s


_INT32 = (-(1 << 31), (1 << 31) - 1)


def _int(name, v, lo=_INT32[0], hi=_INT32[1]):
    """v as an int headed for C, refused (naming the argument) unless it is an integer (not a
    bool, not a float) in [lo, hi]: ctypes would wrap 2**32 + 5 to 5 silently."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name}: expected an integer, got {type(v).__name__} {v!r}")
    v = int(v)
    if not lo <= v <= hi:
        raise ValueError(f"{name} = {v} is out of range [{lo}, {hi}]")
    return v


def _seed(v):
    return _int("seed", v, 0, (1 << 64) - 1)


class _Handle:
    """An owned kiln handle: close() frees it once through _free (a library function name);
    garbage collection closes it too. Handles cannot be copied or pickled (each owns C memory
    that a copy would free twice); a closed handle refuses further use.

    Every method reads the C pointer through the _h property, which (1) refuses a Context or
    Trainer (_AFFINE_FREES) on a thread other than the one that made it (KilnThreadError:
    their C state serves one thread at a time, and two Python threads would otherwise call
    into it at once, the GIL released around each C call), and (2) notes the handle as this
    thread's last, so that _check closes it when its call reports a poisoned backend
    (KilnPoisoned). close() may run on any thread (garbage collection does). _lent() hands an
    affine handle to another thread for a block, while its owner waits."""
    _free = None
    _raw = None     # the C pointer (c_void_p), None once closed
    _thread = None  # ident of the thread that made it
    _AFFINE_FREES = frozenset({"kiln_context_free", "kiln_trainer_free", "kiln_teacher_free"})
    _BACKEND_FREES = frozenset({"kiln_context_free", "kiln_trainer_free", "kiln_linear_ce_free"})

    @property
    def _h(self):
        h = self._raw
        if h and self._free in _Handle._AFFINE_FREES and self._thread != threading.get_ident():
            raise KilnThreadError(-1, f"kiln.{type(self).__name__}: used from thread "
                                      f"{threading.current_thread().name!r}; it belongs to the thread "
                                      f"that made it (ident {self._thread}): make one per thread")
        _tls.last = weakref.ref(self)  # weak: noting it must not keep it alive
        return h

    @_h.setter
    def _h(self, value):
        self._raw = value
        if value and self._thread is None:
            self._thread = threading.get_ident()

    @contextlib.contextmanager
    def _lent(self):
        """Let the current thread use this handle inside the block (its owner must not use it
        meanwhile: Model.stream's worker, which the consumer waits for)."""
        owner, self._thread = self._thread, threading.get_ident()
        try:
            yield self
        finally:
            self._thread = owner

    def poisoned(self) -> bool:
        """Whether a device failure has poisoned this handle's backend (Context, Trainer,
        LinearCrossEntropy; False for the others and once closed). Such a handle refuses
        every call: close it."""
        if not self._raw or self._free not in _Handle._BACKEND_FREES:
            return False
        fn = getattr(self._lib, self._free.replace("_free", "_status"))
        return fn(self._raw) == KILN_ERR_POISONED

    def _owns(self):
        return True

    def __copy__(self):
        raise TypeError(f"a kiln.{type(self).__name__} cannot be copied (it owns C memory)")

    def __deepcopy__(self, memo):
        raise TypeError(f"a kiln.{type(self).__name__} cannot be copied (it owns C memory)")

    def __reduce_ex__(self, protocol):
        raise TypeError(f"a kiln.{type(self).__name__} cannot be pickled (it owns C memory)")

    def _live(self):
        """The C handle, or KilnError when the handle was closed."""
        h = self._h
        if not h:
            raise KilnError(-1, f"kiln.{type(self).__name__}: used after close()")
        return h

    def close(self) -> None:
        """Free the handle now (idempotent; from any thread)."""
        if self._raw and self._owns():
            getattr(self._lib, self._free)(self._raw)
        self._raw = None
        parent = getattr(self, "model", None)
        if isinstance(parent, Model):
            parent._user_closed(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Tokenizer(_Handle):
    """A tokenizer: owned (from a path) or borrowed from a Model."""

    _free = "kiln_tokenizer_close"

    def __init__(self, path=None, _handle=None, _owner=None):
        self._lib = load_library()
        self._owned = _handle is None
        self._owner = _owner
        if _handle is None:
            h = C.c_void_p()
            _check(self._lib.kiln_tokenizer_open(str(path).encode(), C.byref(h)))
            _handle = h
        self._h = _handle

    def encode(self, text: Union[str, bytes], add_special: bool = True,
               parse_special: bool = True) -> List[int]:
        """Token ids of text (str, or UTF-8 bytes); see Model.tokenize."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        n = C.c_size_t(0)
        st = self._lib.kiln_tokenize(self._h, data, len(data), int(add_special),
                                     int(parse_special), None, 0, C.byref(n))
        if st not in (0, 9):
            _check(st)
        buf = (C.c_int32 * max(n.value, 1))()
        _check(self._lib.kiln_tokenize(self._h, data, len(data), int(add_special),
                                       int(parse_special), buf, n.value, C.byref(n)))
        return list(buf[: n.value])

    def decode_bytes(self, ids: Sequence[int], render_special: bool = False) -> bytes:
        """The bytes ids stand for (kiln_detokenize)."""
        arr = (C.c_int32 * max(len(ids), 1))(*ids)
        n = C.c_size_t(0)
        st = self._lib.kiln_detokenize(self._h, arr, len(ids), int(render_special), None, 0,
                                       C.byref(n))
        if st not in (0, 9):
            _check(st)
        buf = C.create_string_buffer(n.value + 1)
        _check(self._lib.kiln_detokenize(self._h, arr, len(ids), int(render_special), buf,
                                         n.value + 1, C.byref(n)))
        return buf.raw[: n.value]

    def decode(self, ids: Sequence[int], render_special: bool = False) -> str:
        """Text of ids; bytes that are not UTF-8 become U+FFFD (decode_bytes keeps them)."""
        return self.decode_bytes(ids, render_special).decode("utf-8", "replace")

    def piece(self, i):
        p = self._lib.kiln_token_piece(self._h, i)
        return None if p is None else p.decode("utf-8", "replace")

    def fingerprint(self) -> str:
        """kiln_tokenizer_fingerprint: SHA-256 of the vocabulary's pieces, as hex."""
        return _fingerprint(self._lib.kiln_tokenizer_fingerprint, self._h)

    def _owns(self):
        return self._owned  # a model's tokenizer is freed with the model


Message = Union[Dict[str, str], Tuple[str, str]]

_STREAM_DONE = object()


class Model(_Handle):
    """A model opened from a GGUF file or a Hugging Face folder (kiln_model_open).

    The Pythonic calls (generate, stream, chat) share one inference context that the model
    makes on first use (n_ctx tokens; 0 = the model's training context, at most 8192) and
    frees with the model; kiln_generate reuses its cache for the prefix a new prompt shares
    with the last one, so a chat that re-sends its history is cheap. A Model is not thread
    safe: use one per thread (or a Context of your own per thread)."""

    _free = "kiln_model_close"

    def __init__(self, path, n_threads=0, f32=False, use_mmap=True, n_ctx=0):
        import weakref
        self._lib = load_library()
        self._ctx = None        # the shared context of generate/stream/chat, made on first use
        self._ctx_busy = False  # a stream still holds it: another call gets a context of its own
        self._users = weakref.WeakSet()  # open Contexts and Trainers on this model
        self._close_pending = False
        n_ctx, n_threads = _int("n_ctx", n_ctx, 0), _int("n_threads", n_threads, 0, 256)
        self._n_ctx, self._n_threads = n_ctx, n_threads
        p = self._lib.kiln_model_default_params()
        p.n_threads = n_threads
        p.weight_mode = 1 if f32 else 0
        p.use_mmap = int(use_mmap)
        h = C.c_void_p()
        _check(self._lib.kiln_model_open(str(path).encode(), C.byref(p), C.byref(h)))
        self._h = h
        info = _ModelInfo()
        _check(self._lib.kiln_model_get_info(self._h, C.byref(info)))
        # the C strings (architecture, name) as str; NULL as None
        self.info = {k: (v.decode("utf-8", "replace") if isinstance(v, bytes) else v)
                     for k, v in ((k, getattr(info, k)) for k, _ in _ModelInfo._fields_)}
        self.n_vocab = info.n_vocab
        self.tokenizer = Tokenizer(_handle=self._lib.kiln_model_get_tokenizer(self._h), _owner=self)

    def fingerprint(self) -> str:
        """kiln_model_fingerprint: SHA-256 over the weights as stored, as hex
        (docs/REPRODUCIBILITY.md, "Fingerprints")."""
        return _fingerprint(self._lib.kiln_model_fingerprint, self._h)

    def close(self) -> None:
        """Free the shared context, then the model. While Contexts or Trainers made on this
        model are open, the model is freed when the last of them closes (never under them)."""
        if self._ctx is not None:
            self._ctx.close()
            self._ctx = None
        if any(u._raw for u in list(self._users)):
            self._close_pending = True
            return
        super().close()

    def _user_opened(self, user):
        if not self._raw:
            raise KilnError(-1, "kiln.Model: used after close()")
        self._users.add(user)

    def _user_closed(self, user):
        self._users.discard(user)
        if self._close_pending and not any(u._raw for u in list(self._users)):
            self._close_pending = False
            _Handle.close(self)

    # ---- tokens ---------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> List[int]:
        """Token ids of text. add_special adds BOS/EOS as the model's tokenizer does;
        parse_special makes special-token strings (e.g. "<|im_start|>") their ids."""
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int], render_special: bool = False) -> str:
        """Text of ids (special tokens left out unless render_special)."""
        return self.tokenizer.decode(list(ids), render_special=render_special)

    def apply_chat_template(self, messages: Iterable[Message],
                            add_generation_prompt: bool = True) -> str:
        """The prompt text of messages ({"role", "content"} dicts or (role, content) pairs)
        in the model's chat template (kiln_chat_apply: chatml, llama3 or gemma; KilnError
        for a template kiln does not know)."""
        msgs = [(m["role"], m["content"]) if isinstance(m, dict) else tuple(m) for m in messages]
        arr = (_ChatMessage * max(len(msgs), 1))(
            *[_ChatMessage(r.encode("utf-8"), c.encode("utf-8")) for r, c in msgs])
        tok = self.tokenizer._h
        n = C.c_size_t(0)
        st = self._lib.kiln_chat_apply(tok, arr, len(msgs), int(add_generation_prompt), None, 0,
                                       C.byref(n))
        if st not in (0, 9):
            _check(st)
        buf = C.create_string_buffer(n.value + 1)
        _check(self._lib.kiln_chat_apply(tok, arr, len(msgs), int(add_generation_prompt), buf,
                                         n.value + 1, C.byref(n)))
        return buf.raw[: n.value].decode("utf-8", "replace")

    # ---- generation -----------------------------------------------------------------------

    def _prompt_ids(self, prompt: Union[str, Sequence[int]], add_special: bool = True) -> List[int]:
        return self.tokenize(prompt, add_special=add_special) if isinstance(prompt, str) else list(prompt)

    def _acquire_context(self) -> "Context":
        """The shared context, or a new one (freed by _release_context) while a stream holds it
        or on a thread other than the shared one's (Contexts are thread-affine)."""
        shared = self._ctx
        if self._ctx_busy or (shared is not None and shared._raw and shared._thread != threading.get_ident()):
            return Context(self, n_ctx=self._n_ctx, n_threads=self._n_threads)
        if self._ctx is None or not self._ctx._raw:  # none yet, or closed by KilnPoisoned
            self._ctx = Context(self, n_ctx=self._n_ctx, n_threads=self._n_threads)
        self._ctx_busy = True
        return self._ctx

    def _release_context(self, ctx: "Context") -> None:
        if ctx is self._ctx:
            self._ctx_busy = False
        else:
            ctx.close()

    def generate(self, prompt: Union[str, Sequence[int]], max_tokens: int = 128,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                 stop: Optional[Sequence[str]] = None, min_p: float = 0.0,
                 repeat_penalty: float = 1.0, ignore_eos: bool = False,
                 add_special: bool = True) -> str:
        """Generate a continuation of prompt (text, tokenized with the model's tokenizer, or
        token ids) and return its text: at most max_tokens tokens, ending at an
        end-of-generation token (unless ignore_eos) or before the first of the stop strings.
        temperature <= 0 is greedy (the default); top_k <= 0 and top_p >= 1 are off; seed
        makes sampling reproducible. Context.generate gives the ids and stop reason too."""
        ids = self._prompt_ids(prompt, add_special)
        ctx = self._acquire_context()
        try:
            return ctx._generate(ids, None, max_tokens=max_tokens, temperature=temperature,
                                 top_k=top_k, top_p=top_p, min_p=min_p,
                                 repeat_penalty=repeat_penalty, seed=seed, stop=stop,
                                 ignore_eos=ignore_eos)["text"]
        finally:
            self._release_context(ctx)

    def stream(self, prompt: Union[str, Sequence[int]], max_tokens: int = 128,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
               stop: Optional[Sequence[str]] = None, min_p: float = 0.0,
               repeat_penalty: float = 1.0, ignore_eos: bool = False,
               add_special: bool = True) -> Iterator[str]:
        """As generate, but yields the text as it is generated, in pieces whose concatenation
        is generate's text (text that could still become a stop string is held back until it
        cannot). kiln_generate runs in a worker thread and hands each token's text over from
        its on_token callback; leaving the loop early (break, close(), an exception) stops the
        generation at the next token."""
        ids = self._prompt_ids(prompt, add_special)
        kw = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                  min_p=min_p, repeat_penalty=repeat_penalty, seed=seed, stop=stop,
                  ignore_eos=ignore_eos)
        return self._stream(ids, kw)

    def _stream(self, ids: List[int], kw: dict) -> Iterator[str]:
        pieces: "queue.Queue" = queue.Queue()
        cancel = threading.Event()

        def on_token(token_id, text, n, user):
            if n:
                pieces.put(C.string_at(text, n))
            return 1 if cancel.is_set() else 0

        callback = _TokenCallback(on_token)  # kept alive until the worker is joined
        ctx = self._acquire_context()

        def work():
            try:
                with ctx._lent():  # the consumer waits on pieces meanwhile
                    ctx._generate(ids, callback, **kw)  # KilnError raised here, in this thread,
                pieces.put(_STREAM_DONE)                # reads this thread's kiln_last_error
            except BaseException as e:  # handed to the consumer
                pieces.put(e)

        worker = threading.Thread(target=work, name="kiln-stream", daemon=True)
        worker.start()
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        try:
            while True:
                item = pieces.get()
                if item is _STREAM_DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                text = utf8.decode(item)
                if text:
                    yield text
            tail = utf8.decode(b"", final=True)
            if tail:
                yield tail
        finally:
            cancel.set()
            worker.join()
            self._release_context(ctx)

    def chat(self, messages: Iterable[Message], max_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int = 0,
             stop: Optional[Sequence[str]] = None, **kw) -> str:
        """The assistant's reply to messages ({"role": "system"|"user"|"assistant", "content"}
        dicts or (role, content) pairs), prompted through the model's chat template with the
        generation prompt and tokenized as Hugging Face's apply_chat_template does (special
        tokens parsed, none added). Other keywords as generate."""
        ids = self.tokenize(self.apply_chat_template(messages), add_special=False)
        return self.generate(ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                             top_k=top_k, seed=seed, stop=stop, **kw)

    def chat_stream(self, messages: Iterable[Message], max_tokens: int = 128,
                    temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                    stop: Optional[Sequence[str]] = None, **kw) -> Iterator[str]:
        """chat, streamed as stream does."""
        ids = self.tokenize(self.apply_chat_template(messages), add_special=False)
        return self.stream(ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                           top_k=top_k, seed=seed, stop=stop, **kw)


class Context(_Handle):
    """An inference context on a Model: its KV cache (n_ctx tokens; 0 = the model's training
    context, at most 8192) and scratch, for decode (logits) and generate (ids in, ids and text
    out). Usable as a context manager; must not outlive its model."""

    _free = "kiln_context_free"

    def __init__(self, model, n_ctx=0, n_batch=512, n_threads=0, device=-1, fast=False, n_seq=1,
                 batch_invariant=False, format="f32"):
        """device: -1 = CPU, N >= 0 = CUDA device N (bit-identical to the CPU unless fast).
        fast: the backend's fast arithmetic (CPU: 8-bit activations; CUDA: bf16 tensor cores).
        batch_invariant: with fast, a token's logits never depend on the batch (kiln serve
        --fast --batch-invariant's arithmetic): on the CPU the 8-bit path at every batch size
        (what fast is already), on CUDA kernels chosen without regard to the batch's size
        (docs/CUDA.md, "The batch-invariant fast mode"; slower than plain fast).
        format: "f32" (default), "mx16" or "mx8": the matrix products in an exact block format
        (docs/ARITHMETIC.md, "Exact block formats"; the same bits on the CPU and CUDA), then
        optional per-weight rules, as `kiln generate --format`: "mx8,output=mx16,blk.0=f32"."""
        fmt, rules = _format_spec(format)
        self._lib = load_library()
        p = self._lib.kiln_context_default_params()
        p.n_ctx, p.n_batch = _int("n_ctx", n_ctx, 0), _int("n_batch", n_batch, 0)
        p.n_threads, p.device = _int("n_threads", n_threads, 0, 256), _int("device", device)
        p.fast = 1 if fast else 0
        p.n_seq = _int("n_seq", n_seq, 0)
        p.batch_invariant = 1 if batch_invariant else 0
        p.format, p.format_rules = fmt, rules
        model._user_opened(self)
        self.model = model
        h = C.c_void_p()
        _check(self._lib.kiln_context_create(model._h, C.byref(p), C.byref(h)))
        self._h = h

    @property
    def n_past(self) -> int:
        """Tokens the cache holds (sequence 0)."""
        return self._lib.kiln_context_n_past(self._h)

    def truncate(self, n_past: int = 0) -> None:
        """Keep the first n_past cached tokens, drop the rest."""
        _check(self._lib.kiln_context_truncate(self._live(), _int("n_past", n_past, 0)))

    def decode(self, ids, all_logits=False):
        """Append ids to the cache; returns logits as a list of rows (all_logits) or one row."""
        import numpy as np
        V = self.model.n_vocab
        arr = (C.c_int32 * len(ids))(*ids)
        rows = len(ids) if all_logits else 1
        out = np.empty((rows, V), dtype=np.float32)
        _check(self._lib.kiln_decode(self._h, arr, len(ids), int(all_logits),
                                     out.ctypes.data_as(C.POINTER(C.c_float))))
        return out if all_logits else out[0]

    def decode_seq(self, seq, ids, all_logits=False):
        """decode on sequence seq (n_seq > 1); logits as decode."""
        import numpy as np
        V = self.model.n_vocab
        arr = (C.c_int32 * len(ids))(*ids)
        rows = len(ids) if all_logits else 1
        out = np.empty((rows, V), dtype=np.float32)
        _check(self._lib.kiln_decode_seq(self._h, seq, arr, len(ids), int(all_logits),
                                         out.ctypes.data_as(C.POINTER(C.c_float))))
        return out if all_logits else out[0]

    def decode_batch(self, ids, logits=True):
        """One token for each of sequences 0..len(ids)-1 in one forward; (B, V) logits or None."""
        import numpy as np
        arr = (C.c_int32 * len(ids))(*ids)
        out = np.empty((len(ids), self.model.n_vocab), dtype=np.float32) if logits else None
        ptr = out.ctypes.data_as(C.POINTER(C.c_float)) if logits else None
        _check(self._lib.kiln_decode_batch(self._h, arr, len(ids), ptr))
        return out

    def seq_n_past(self, seq):
        return self._lib.kiln_context_seq_n_past(self._h, seq)

    def generate(self, prompt_ids: Sequence[int], max_tokens: int = 32, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 repeat_penalty: float = 1.0, seed: int = 0, stop: Optional[Sequence[str]] = None,
                 ignore_eos: bool = False, logits_chain: bool = False) -> dict:
        """Prefill prompt_ids and generate (kiln_generate; the cache is reused for the prefix
        the prompt shares with what this context holds). temperature <= 0 is greedy. Returns
        {"ids", "text", "stop_reason", "n_prompt_cached"}; text has a stop string removed.
        logits_chain: also "logits_chain", the receipt's hash chain c_0 .. c_n as hex
        (docs/REPRODUCIBILITY.md)."""
        return self._generate(prompt_ids, None, max_tokens=max_tokens, temperature=temperature,
                              top_k=top_k, top_p=top_p, min_p=min_p,
                              repeat_penalty=repeat_penalty, seed=seed, stop=stop,
                              ignore_eos=ignore_eos, logits_chain=logits_chain)

    def _generate(self, prompt_ids, on_token, max_tokens=32, temperature=0.0, top_k=0, top_p=1.0,
                  min_p=0.0, repeat_penalty=1.0, seed=0, stop=None, ignore_eos=False,
                  logits_chain=False):
        """generate, with on_token (a _TokenCallback, kept alive by the caller) or None."""
        self._live()
        gp = self._lib.kiln_generate_default_params()
        gp.max_tokens = _int("max_tokens", max_tokens, 0)
        gp.sampler.temperature = temperature
        gp.sampler.top_k = _int("top_k", top_k)
        gp.sampler.top_p = top_p
        gp.sampler.min_p = min_p
        gp.sampler.repeat_penalty = repeat_penalty
        gp.sampler.seed = _seed(seed)
        gp.ignore_eos = int(ignore_eos)
        keep = None
        if stop:
            keep = (C.c_char_p * (len(stop) + 1))(*[s.encode() for s in stop], None)
            gp.stop_strings = keep
        if on_token is not None:
            gp.on_token = on_token
        chain = None
        if logits_chain:
            chain = C.create_string_buffer(32 * (gp.max_tokens + 1))
            gp.logits_chain = C.cast(chain, C.c_void_p)
        arr = (C.c_int32 * max(len(prompt_ids), 1))(*prompt_ids)
        res = _GenerateResult()
        _check(self._lib.kiln_generate(self._h, arr, len(prompt_ids), C.byref(gp), C.byref(res)))
        try:
            out = {
                "ids": [res.ids[i] for i in range(res.n_ids)],
                "text": C.string_at(res.text, res.text_len).decode("utf-8", "replace"),
                "stop_reason": res.stop_reason.decode(),
                "n_prompt_cached": res.n_prompt_cached,
            }
            if chain is not None:
                out["logits_chain"] = [chain.raw[32 * i:32 * (i + 1)].hex() for i in range(res.n_ids + 1)]
        finally:
            self._lib.kiln_generate_result_free(C.byref(res))
        return out



STORAGE = {"f32": 0, "bf16_master": 1, "bf16_kahan": 2, "bf16_sr": 3}
MOMENTS = {"f32": 0, "q8": 1}


def _fingerprint(fn, h):
    out = C.create_string_buffer(32)
    _check(fn(h, out))
    return out.raw.hex()


def _i32(a):
    return (C.c_int32 * max(len(a), 1))(*a)


class Teacher(_Handle):
    """A distillation teacher: `model`'s inference forward on `trainer`'s backend, for
    Trainer.distill_step (kiln_teacher_create). The two models must share the tokenizer."""

    _free = "kiln_teacher_free"

    def __init__(self, model, trainer, hidden=None, hidden_loss="mse"):
        """hidden: [(student_layer, teacher_layer), ...] (counted from 1) for hidden-state
        matching; when the widths differ the trainer needs the projections
        (Trainer(extra=kiln.hidden_projections(teacher_model, student_model, len(hidden))))."""
        self._lib = load_library()
        hidden = list(hidden or [])
        if hidden_loss not in HIDDEN_LOSSES:
            raise ValueError(f"hidden_loss {hidden_loss!r}: one of {sorted(HIDDEN_LOSSES)}")
        pairs = (_HiddenPair * max(1, len(hidden)))(*[_HiddenPair(_int("student_layer", s), _int("teacher_layer", t))
                                                      for s, t in hidden])
        tp = _TeacherParams(len(hidden), C.cast(pairs, C.c_void_p), HIDDEN_LOSSES[hidden_loss])
        model._user_opened(self)
        self.model, self.trainer, self.hidden = model, trainer, hidden
        h = C.c_void_p()
        _check(self._lib.kiln_teacher_create_ex(model._h, trainer._live(), C.byref(tp), C.byref(h)))
        self._h = h
        if not hasattr(trainer, "_teachers"):
            trainer._teachers = weakref.WeakSet()
        trainer._teachers.add(self)


class Trainer(_Handle):
    """Training over a Model's parameters (named as in transformers), on the CPU or a CUDA GPU."""

    _free = "kiln_trainer_free"

    @staticmethod
    def _device_index(device):
        """-1 / "cpu" -> -1; N / "cuda" / "cuda:N" -> N (0 for "cuda"), as `--device`."""
        if isinstance(device, str):
            if device == "cpu":
                return -1
            if device == "cuda":
                return 0
            if device.startswith("cuda:") and device[5:].isdigit():
                return int(device[5:])
            raise ValueError(f"device {device!r}: expected -1, N >= 0, 'cpu', 'cuda' or 'cuda:N'")
        return _int("device", device)

    def __init__(self, model, max_seq=256, n_threads=0, ce_chunk=0, lr=1e-3, betas=(0.9, 0.999),
                 eps=1e-8, weight_decay=0.01, storage="f32", moments="f32", seed=0, device=-1,
                 fast=False, max_batch=1, ce_keep_mib=None, ce_row_block=None,
                 ce_logits_f32=False, extra=None, format="f32", format_rounding="nearest"):
        """device: -1 or "cpu" = CPU; N, "cuda" or "cuda:N" = CUDA device N (the CPU's bits;
        checkpoints move between the two). fast=True (GPU only): matrix products on bf16
        tensor cores, not the CPU's bits but deterministic run to run (docs/TRAINING.md).
        ce_keep_mib (CPU): MiB the fused loss may keep of the forward's logits for the
        backward (None: the library's default, 64; 0: none); the same bits either way.
        ce_row_block (GPU fast mode, step_batch): rows per block of the fused loss's row walk
        (None: the library's default, 2048; 0: the vocabulary walk, the bits of
        forward_batch + backward). ce_logits_f32: that walk keeps each block's logits in f32
        (default False: bf16, as autocast's head output; half the loss's scratch)."""
        self._lib = load_library()
        p = self._lib.kiln_train_default_params()
        p.max_seq, p.n_threads = _int("max_seq", max_seq, 1), _int("n_threads", n_threads, 0, 256)
        p.ce_chunk = _int("ce_chunk", ce_chunk)
        p.lr, p.beta1, p.beta2, p.eps, p.weight_decay = lr, betas[0], betas[1], eps, weight_decay
        p.weight_storage, p.moment_storage, p.seed = STORAGE[storage], MOMENTS[moments], _seed(seed)
        p.device = _int("device", self._device_index(device))
        p.fast = 1 if fast else 0
        p.max_batch = _int("max_batch", max_batch, 1)  # sequences one forward_batch takes
        if ce_keep_mib is not None:
            p.ce_keep_mib = _int("ce_keep_mib", ce_keep_mib)
        if ce_row_block is not None:
            p.ce_row_block = _int("ce_row_block", ce_row_block)
        p.ce_logits_f32 = 1 if ce_logits_f32 else 0
        # extra: [(name, rows, cols)] matrices trained with the model that its forward does not
        # use (hidden-state projections: kiln.hidden_projections)
        extra = list(extra or [])
        ext = (_TrainExtra * max(1, len(extra)))(*[_TrainExtra(n.encode(), _int("rows", r, 1), _int("cols", c, 1))
                                                   for n, r, c in extra])
        p.n_extra, p.extra = len(extra), C.cast(ext, C.c_void_p)
        # format: the matrix products forward and backward in f32 (auditable) or an exact block
        # format ("mx16", "mx8"; the same bits on the CPU and CUDA; docs/ARITHMETIC.md), then
        # optional per-weight rules ("mx8,output=mx16")
        p.format, p.format_rules = _format_spec(format)
        # format_rounding: with an exact format, the backward's gradients quantized to nearest
        # even (default) or stochastically, seeded by seed, the step and the micro-batch
        rounding = {"nearest": 0, "stochastic": 1}
        if format_rounding not in rounding:
            raise ValueError(f"format_rounding {format_rounding!r}: one of {sorted(rounding)}")
        p.format_rounding = rounding[format_rounding]
        model._user_opened(self)
        self.model = model
        h = C.c_void_p()
        _check(self._lib.kiln_trainer_create(model._h, C.byref(p), C.byref(h)))
        self._h = h
        self.C = model.info["n_embd"]

    def params(self):
        out = []
        for i in range(self._lib.kiln_train_n_params(self._h)):
            name, n, shape = C.c_char_p(), C.c_int64(), (C.c_int64 * 2)()
            _check(self._lib.kiln_train_param_info(self._h, i, C.byref(name), C.byref(n), shape))
            out.append((name.value.decode(), n.value, (shape[0], shape[1])))
        return out

    def fingerprint(self) -> str:
        """kiln_train_fingerprint: the fingerprint of the current parameters (that of an f32
        export of them), as hex."""
        return _fingerprint(self._lib.kiln_train_fingerprint, self._h)

    def _get(self, fn, name, n):
        import numpy as np
        out = np.empty(n, dtype=np.float32)
        _check(fn(self._h, name.encode(), out.ctypes.data_as(C.POINTER(C.c_float)), n))
        return out

    def get_param(self, name, n):
        return self._get(self._lib.kiln_train_get_param, name, n)

    def get_grad(self, name, n):
        return self._get(self._lib.kiln_train_get_grad, name, n)

    def set_param(self, name, values):
        import numpy as np
        a = np.ascontiguousarray(values, dtype=np.float32).ravel()
        _check(self._lib.kiln_train_set_param(self._h, name.encode(),
                                              a.ctypes.data_as(C.POINTER(C.c_float)), a.size))

    def set_params(self, named):
        """Import {name: array} all at once; nothing changes unless every entry is valid."""
        import numpy as np
        items = [(k, np.ascontiguousarray(v, dtype=np.float32).ravel()) for k, v in named.items()]
        names = (C.c_char_p * len(items))(*[k.encode() for k, _ in items])
        ptrs = (C.POINTER(C.c_float) * len(items))(*[a.ctypes.data_as(C.POINTER(C.c_float)) for _, a in items])
        sizes = (C.c_int64 * len(items))(*[a.size for _, a in items])
        _check(self._lib.kiln_train_set_params(self._h, len(items), names, ptrs, sizes))

    def forward(self, ids, targets, reduction="mean", scale=1.0):
        loss = C.c_float()
        _check(self._lib.kiln_train_forward(self._h, _i32(ids), len(ids), _i32(targets),
                                            0 if reduction == "mean" else 1, scale, C.byref(loss)))
        return loss.value

    @staticmethod
    def _batch(what, ids, targets):
        """ids, targets as contiguous int32 2-D arrays of one shape (ValueError otherwise)."""
        import numpy as np
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        targets = np.ascontiguousarray(targets, dtype=np.int32)
        if ids.ndim != 2 or targets.shape != ids.shape:
            raise ValueError(f"{what}: ids and targets must be 2-D arrays of one shape")
        return ids, targets

    def forward_batch(self, ids, targets, reduction="mean", scale=1.0):
        """ids, targets: n_seq sequences of equal length (lists or a 2-D array), forwarded at
        once (kiln_train_forward_batch); the loss reduces over all of them."""
        ids, targets = self._batch("forward_batch", ids, targets)
        loss = C.c_float()
        P32 = C.POINTER(C.c_int32)
        _check(self._lib.kiln_train_forward_batch(self._h, ids.ctypes.data_as(P32), ids.shape[0],
                                                  ids.shape[1], targets.ctypes.data_as(P32),
                                                  0 if reduction == "mean" else 1, scale,
                                                  C.byref(loss)))
        return loss.value

    def step_batch(self, ids, targets, reduction="mean", scale=1.0, accumulate=False):
        """forward_batch + backward(accumulate=accumulate) in one call (kiln_train_step_batch):
        the same loss and gradients; on a GPU in fast mode the host does not wait between the
        forward and the backward, and the loss walks the rows in blocks (ce_row_block; 0: the
        vocabulary walk, the same bits as the two calls). Returns the loss."""
        ids, targets = self._batch("step_batch", ids, targets)
        loss = C.c_float()
        P32 = C.POINTER(C.c_int32)
        _check(self._lib.kiln_train_step_batch(self._h, ids.ctypes.data_as(P32), ids.shape[0],
                                               ids.shape[1], targets.ctypes.data_as(P32),
                                               0 if reduction == "mean" else 1, scale,
                                               int(accumulate), C.byref(loss)))
        return loss.value

    def distill_step(self, teacher, ids, targets, temperature=1.0, kd_weight=0.5, ce_weight=0.5,
                     reduction="mean", scale=1.0, accumulate=False, hidden_weight=1.0):
        """A training step on the distillation loss against teacher (a kiln.Teacher made for
        this trainer; kiln_train_distill_step): per supervised row
        kd_weight * temperature^2 * KL(teacher || student at temperature) + ce_weight * CE,
        reduced and scaled as step_batch's loss. Returns {"loss", "kl", "ce", "n_supervised"}
        (kl and ce reduced and scaled alike, unweighted)."""
        if not isinstance(teacher, Teacher) or teacher.trainer is not self:
            raise ValueError("distill_step: teacher must be a kiln.Teacher made for this trainer")
        ids, targets = self._batch("distill_step", ids, targets)
        dp = _DistillParams(temperature, kd_weight, ce_weight, hidden_weight)
        out = _DistillLoss()
        P32 = C.POINTER(C.c_int32)
        _check(self._lib.kiln_train_distill_step(self._h, teacher._live(), ids.ctypes.data_as(P32),
                                                 ids.shape[0], ids.shape[1],
                                                 targets.ctypes.data_as(P32), C.byref(dp),
                                                 0 if reduction == "mean" else 1, scale,
                                                 int(accumulate), C.byref(out)))
        return {"loss": out.loss, "kl": out.kl, "ce": out.ce, "hidden": out.hidden, "n_supervised": out.n_supervised}

    def close(self) -> None:
        for t in list(getattr(self, "_teachers", ())):  # a teacher holds the trainer's backend
            t.close()
        super().close()

    def forward_hidden(self, ids, positions):
        import numpy as np
        out = np.empty((len(positions), self.C), dtype=np.float32)
        _check(self._lib.kiln_train_forward_hidden(self._h, _i32(ids), len(ids), _i32(positions),
                                                   len(positions),
                                                   out.ctypes.data_as(C.POINTER(C.c_float))))
        return out

    def backward(self, dhidden=None, accumulate=False):
        import numpy as np
        ptr = None
        if dhidden is not None:
            dhidden = np.ascontiguousarray(dhidden, dtype=np.float32)
            ptr = dhidden.ctypes.data_as(C.POINTER(C.c_float))
        _check(self._lib.kiln_train_backward(self._h, ptr, int(accumulate)))

    def discard(self):
        _check(self._lib.kiln_train_discard(self._h))

    def step(self, ids):
        loss = C.c_float()
        _check(self._lib.kiln_train_step(self._h, _i32(ids), len(ids), C.byref(loss)))
        return loss.value

    def grad_sq_norm(self):
        out = C.c_double()
        _check(self._lib.kiln_train_grad_sq_norm(self._h, C.byref(out)))
        return out.value

    def clip_grads(self, max_norm):
        total, coef = C.c_float(), C.c_float()
        _check(self._lib.kiln_train_clip_grads(self._h, max_norm, C.byref(total), C.byref(coef)))
        return total.value, coef.value

    def optimizer_step(self, lr):
        _check(self._lib.kiln_train_optimizer_step(self._h, lr))

    def describe(self):
        buf = C.create_string_buffer(1024)
        mem = TrainMemory()
        _check(self._lib.kiln_train_describe(self._h, buf, 1024, C.byref(mem)))
        return buf.value.decode(), {k: getattr(mem, k) for k, _ in TrainMemory._fields_}

    def save(self, directory, step, run_json=None, keep_last=0):
        _check(self._lib.kiln_train_save(self._h, str(directory).encode(), step,
                                          run_json.encode() if run_json else None, keep_last))

    def load(self, directory):
        step, run = C.c_uint64(), C.c_void_p()
        _check(self._lib.kiln_train_load(self._h, str(directory).encode(), C.byref(step), C.byref(run)))
        text = None
        if run.value:
            text = C.string_at(run.value).decode()
            self._lib.kiln_string_free(run)
        return step.value, text


    # ---- torch interop: parameters, gradients, moments as torch tensors (torch imported
    # lazily; docs/TRAINING.md, "torch interop"). Every tensor handed out is a CPU float32 copy
    # in transformers' shape; every tensor taken in is read as float32 on the CPU. ----------

    def _torch_params(self):
        """[(name, n, torch shape)] in kiln_train_param_info's order (transformers'
        named_parameters() order), cached."""
        if getattr(self, "_tshapes", None) is None:
            out = []
            for i, (name, n, _) in enumerate(self.params()):
                nd, shape = C.c_int(), (C.c_int64 * 3)()
                _check(self._lib.kiln_train_param_file_shape(self._live(), i, C.byref(nd), shape))
                out.append((name, n, tuple(shape[k] for k in range(nd.value))))
            self._tshapes = out
        return self._tshapes

    @staticmethod
    def _f32(name, x, shape):
        """x (a torch tensor, numpy array or nested list) as a contiguous float32 numpy array of
        exactly `shape` (ValueError naming `name` otherwise)."""
        import numpy as np
        if hasattr(x, "detach"):
            x = x.detach().to("cpu").float().numpy()
        a = np.ascontiguousarray(x, dtype=np.float32)
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(a.shape)}, expected {tuple(shape)}")
        return a

    def parameters(self):
        """{name: float32 CPU torch tensor} of every parameter, transformers' names and shapes
        (copies: writing them changes nothing here; load_parameters writes back)."""
        import torch
        return {name: torch.from_numpy(self.get_param(name, n).reshape(shape))
                for name, n, shape in self._torch_params()}

    def load_parameters(self, named):
        """Write {name: tensor} (any subset of parameters(), each of its shape) at once: every
        name, shape and value is checked before anything is written (kiln_train_set_params).
        bf16 storages round to bf16 and may only be written before the first step."""
        shapes = {name: shape for name, _, shape in self._torch_params()}
        arrays = {}
        for name, x in named.items():
            if name not in shapes:
                raise KeyError(f"load_parameters: no parameter named {name!r}")
            arrays[name] = self._f32(name, x, shapes[name])
        self.set_params(arrays)

    def grads(self):
        """{name: float32 CPU torch tensor} of every gradient (a pending clip coefficient
        applied, as the optimizer would read them)."""
        import torch
        return {name: torch.from_numpy(self.get_grad(name, n).reshape(shape))
                for name, n, shape in self._torch_params()}

    @staticmethod
    def _ids(name, x):
        import numpy as np
        if hasattr(x, "detach"):
            x = x.detach().to("cpu").numpy()
        a = np.asarray(x)
        if a.dtype.kind not in "iu" and a.size:
            raise TypeError(f"{name}: integer ids expected, got {a.dtype}")
        return np.ascontiguousarray(a, dtype=np.int64)

    def train_forward(self, ids, targets, reduction="mean", scale=1.0):
        """The loss of ids against targets (-1 or any negative: not supervised) as a float32
        torch scalar, leaving the step pending for train_backward(). 1-D ids: one sequence
        (forward); 2-D (n_seq, seq): a batch (forward_batch)."""
        import torch
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction {reduction!r}: 'mean' or 'sum'")
        a, t = self._ids("ids", ids), self._ids("targets", targets)
        if a.shape != t.shape or a.ndim not in (1, 2):
            raise ValueError(f"train_forward: ids {a.shape} and targets {t.shape}: one 1-D or 2-D shape")
        if a.ndim == 1:
            loss = self.forward(a.tolist(), t.tolist(), reduction, float(scale))
        else:
            loss = self.forward_batch(a, t, reduction, float(scale))
        return torch.tensor(loss, dtype=torch.float32)

    def hidden(self, ids, positions=None):
        """Final-norm hidden states of one sequence at positions (default: every position) as a
        float32 torch tensor (n_pos, n_embd), leaving the step pending: train_backward(dh)
        takes their gradient (kiln_train_forward_hidden)."""
        import torch
        a = self._ids("ids", ids).reshape(-1)
        pos = list(range(a.size)) if positions is None else self._ids("positions", positions).reshape(-1).tolist()
        return torch.from_numpy(self.forward_hidden(a.tolist(), pos))

    def train_backward(self, dhidden=None, accumulate=False):
        """Backward of the pending step: dhidden None after train_forward, else the gradient of
        hidden()'s output (n_pos, n_embd), any float tensor (read as float32)."""
        if dhidden is not None:
            dhidden = self._f32("dhidden", dhidden, tuple(dhidden.shape))
        self.backward(dhidden, accumulate)

    def clip_coef(self, max_norm, with_norm=False):
        """torch.nn.utils.clip_grad_norm_(params, max_norm)'s clip_coef_clamped, with torch's
        float32 bits, without clipping (kiln_train_clip_coef); with_norm: (total_norm, coef).
        adamw_step(lr, grad_scale=coef) then applies it as clip_grad_norm_ would."""
        total, coef = C.c_float(), C.c_float()
        _check(self._lib.kiln_train_clip_coef(self._live(), float(max_norm), C.byref(total), C.byref(coef)))
        return (total.value, coef.value) if with_norm else coef.value

    def adamw_step(self, lr, weight_decay=None, grad_scale=1.0):
        """One AdamW update (kiln_train_adamw_step), as torch.optim.AdamW.step():
        weight_decay None: the trainer's rule (its weight_decay, none for biases and norms);
        a float: every parameter decays by it (one param group); a dict {name: float}: those
        parameters by their value, the others by the trainer's rule. grad_scale (a float or a
        0-dim tensor, e.g. clip_coef()'s): the gradients are multiplied by it first, as
        p.grad.mul_(grad_scale)."""
        import numpy as np
        names = [name for name, _, _ in self._torch_params()]
        wd = None
        if isinstance(weight_decay, dict):
            unknown = set(weight_decay) - set(names)
            if unknown:
                raise KeyError(f"adamw_step: weight_decay names unknown parameters {sorted(unknown)}")
            vals = []
            for name in names:
                v = float(weight_decay.get(name, -1.0))
                if name in weight_decay and not v >= 0.0:
                    raise ValueError(f"adamw_step: weight_decay[{name!r}] = {v} (must be >= 0)")
                vals.append(v)
            wd = np.asarray(vals, dtype=np.float64)
        elif weight_decay is not None:
            v = float(weight_decay)
            if not v >= 0.0:
                raise ValueError(f"adamw_step: weight_decay = {v} (must be >= 0)")
            wd = np.full(len(names), v, dtype=np.float64)
        ptr = None if wd is None else wd.ctypes.data_as(C.POINTER(C.c_double))
        _check(self._lib.kiln_train_adamw_step(self._live(), float(lr), ptr, float(grad_scale)))

    def adamw_state(self):
        """{name: {"step", "exp_avg", "exp_avg_sq"}} as torch.optim.AdamW's state_dict()["state"]
        holds each parameter (step a float32 scalar tensor, the moments float32 in the
        parameter's shape). f32 moments: the stored values; q8 moments: dequantized."""
        import numpy as np
        import torch
        out = {}
        for name, n, shape in self._torch_params():
            m, v = np.empty(n, np.float32), np.empty(n, np.float32)
            step = C.c_int64()
            P = C.POINTER(C.c_float)
            _check(self._lib.kiln_train_get_moments(self._live(), name.encode(), m.ctypes.data_as(P),
                                                    v.ctypes.data_as(P), n, C.byref(step)))
            out[name] = {"step": torch.tensor(float(step.value), dtype=torch.float32),
                         "exp_avg": torch.from_numpy(m.reshape(shape)),
                         "exp_avg_sq": torch.from_numpy(v.reshape(shape))}
        return out

    def load_adamw_state(self, state):
        """Restore adamw_state()'s dict, or a torch.optim.AdamW state_dict() (its "state" keyed
        by index: the i-th parameter of its param groups is kiln's i-th, parameters() order).
        Every parameter must be present, with one step for all; everything is checked before
        anything is written. Load the parameters first (load_parameters with bf16 storage
        starts a fresh optimizer). f32 moments resume bit for bit; q8 moments are requantized
        (lossy: include/kiln.h, kiln_train_set_moments)."""
        import numpy as np
        params = self._torch_params()
        if isinstance(state, dict) and "state" in state and "param_groups" in state:
            order = [i for g in state["param_groups"] for i in g["params"]]
            if len(order) != len(params):
                raise ValueError(f"load_adamw_state: the state_dict has {len(order)} parameters, "
                                 f"this trainer {len(params)}")
            state = {params[k][0]: state["state"][i] for k, i in enumerate(order) if i in state["state"]}
        missing = [name for name, _, _ in params if name not in state]
        if missing:
            raise KeyError(f"load_adamw_state: no state for {missing[:3]}{'...' if len(missing) > 3 else ''}")
        unknown = set(state) - {name for name, _, _ in params}
        if unknown:
            raise KeyError(f"load_adamw_state: unknown parameters {sorted(unknown)[:3]}")
        steps, arrays = set(), []
        for name, n, shape in params:
            st = state[name]
            steps.add(float(st["step"]))
            m = self._f32(f"{name}.exp_avg", st["exp_avg"], shape).ravel()
            v = self._f32(f"{name}.exp_avg_sq", st["exp_avg_sq"], shape).ravel()
            if not (np.all(np.isfinite(m)) and np.all(np.isfinite(v)) and np.all(v >= 0)):
                raise ValueError(f"load_adamw_state: {name}: moments must be finite, exp_avg_sq >= 0")
            arrays.append((name, n, m, v))
        if len(steps) != 1:
            raise ValueError(f"load_adamw_state: parameters at different steps {sorted(steps)}: kiln keeps one")
        step = steps.pop()
        if step != int(step) or not 0 <= step <= 2 ** 24:
            raise ValueError(f"load_adamw_state: step {step} is not an integer in [0, 2^24]")
        P = C.POINTER(C.c_float)
        for name, n, m, v in arrays:
            _check(self._lib.kiln_train_set_moments(self._live(), name.encode(), m.ctypes.data_as(P),
                                                    v.ctypes.data_as(P), n))
        _check(self._lib.kiln_train_set_optimizer_step_count(self._live(), int(step)))


class LinearCrossEntropy(_Handle):
    """The fused linear cross-entropy (kiln_linear_ce_*): the loss of hidden states (N, H)
    through an LM head (V, H) against targets (N), and its gradients, without the N x V
    logits. device -1 / "cpu": numpy arrays (or CPU torch tensors); N / "cuda" / "cuda:N":
    torch CUDA tensors on that device (kiln reads and writes them in place; targets and mask
    may live anywhere, they are copied to the host). fast=True (CUDA only): bf16 tensor-core
    products, deterministic run to run, not the CPU's bits."""

    _free = "kiln_linear_ce_free"

    def __init__(self, device=-1, fast=False):
        self._lib = load_library()
        self.device = Trainer._device_index(device)
        h = C.c_void_p()
        _check(self._lib.kiln_linear_ce_create(self.device, 1 if fast else 0, C.byref(h)))
        self._h = h

    def _buf(self, name, a, shape, dtypes, writable=False):
        """(address, dtype name) of array a: C-contiguous, of this shape, one of dtypes (names
        such as "float32", "bfloat16", "uint16"), where this handle's device can read it."""
        if hasattr(a, "data_ptr"):  # a torch tensor
            dt = str(a.dtype).replace("torch.", "")
            where = -1 if a.device.type == "cpu" else (a.device.index or 0) if a.device.type == "cuda" else None
            contiguous = a.is_contiguous()
            addr = a.data_ptr()
        else:
            import numpy as np
            if not isinstance(a, np.ndarray):
                raise TypeError(f"{name}: a numpy array or a torch tensor, not {type(a).__name__}")
            dt, where, contiguous = str(a.dtype), -1, a.flags["C_CONTIGUOUS"]
            addr = a.ctypes.data
            if writable and not a.flags["WRITEABLE"]:
                raise ValueError(f"{name}: read-only array")
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(a.shape)}, expected {tuple(shape)}")
        if dt not in dtypes:
            raise ValueError(f"{name}: dtype {dt}, expected {' or '.join(dtypes)}")
        if not contiguous:
            raise ValueError(f"{name}: not contiguous")
        if where != self.device:
            want = "host memory" if self.device < 0 else f"CUDA device {self.device}"
            raise ValueError(f"{name}: not in {want}")
        return addr, dt

    @staticmethod
    def _host(a, dtype):
        """targets / mask as a contiguous host numpy array of dtype (from numpy, a list or any
        torch tensor)."""
        import numpy as np
        if hasattr(a, "detach"):
            a = a.detach().cpu().numpy()
        return np.ascontiguousarray(a, dtype=dtype)

    def __call__(self, hidden, weight, targets, mask=None, reduction="mean", scale=1.0,
                 dhidden=None, dweight=None, dhidden_accumulate=False, row_loss=None, chunk=0,
                 row_block=0):
        """The loss (a float); dhidden (N, H) f32 is overwritten (or added to with
        dhidden_accumulate), dweight (V, H) f32 added to, row_loss (N) f32 written, when given.
        weight: f32, or bf16 (a torch bfloat16 tensor, or uint16 bit patterns). targets < 0 and
        mask == 0 mark positions not supervised. chunk: vocabulary columns per chunk (0 =
        4096); row_block > 0 (CUDA fast mode, bf16 weight, a gradient, no row_loss): the
        row walk, as the trainer's steps (include/kiln.h). Also sets self.last: loss_f64,
        n_supervised, scratch_bytes."""
        import numpy as np
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction {reduction!r}: 'mean' or 'sum'")
        if len(hidden.shape) != 2 or len(weight.shape) != 2 or weight.shape[1] != hidden.shape[1]:
            raise ValueError(f"shapes {tuple(hidden.shape)} and {tuple(weight.shape)}: hidden "
                             "(N, H) and weight (V, H) expected")
        (N, H), V = hidden.shape, weight.shape[0]
        p = self._lib.kiln_linear_ce_default_params()
        p.N, p.H, p.V = N, H, V
        p.hidden, _ = self._buf("hidden", hidden, (N, H), ("float32",))
        p.weight, wdt = self._buf("weight", weight, (V, H), ("float32", "bfloat16", "uint16"))
        p.weight_bf16 = 0 if wdt == "float32" else 1
        t = self._host(targets, np.int32)
        if t.shape != (N,):
            raise ValueError(f"targets: shape {t.shape}, expected ({N},)")
        p.targets = t.ctypes.data
        m = None
        if mask is not None:
            m = self._host(mask, np.uint8)
            if m.shape != (N,):
                raise ValueError(f"mask: shape {m.shape}, expected ({N},)")
            p.mask = m.ctypes.data
        p.reduction = 0 if reduction == "mean" else 1
        p.scale = scale
        if dhidden is not None:
            p.dhidden, _ = self._buf("dhidden", dhidden, (N, H), ("float32",), writable=True)
        p.dhidden_accumulate = 1 if dhidden_accumulate else 0
        if dweight is not None:
            p.dweight, _ = self._buf("dweight", dweight, (V, H), ("float32",), writable=True)
        if row_loss is not None:
            p.row_loss, _ = self._buf("row_loss", row_loss, (N,), ("float32",), writable=True)
        p.chunk, p.row_block = chunk, row_block
        if self.device >= 0:  # kiln runs on its own stream: torch's writes must be done
            import torch
            torch.cuda.synchronize(self.device)
        r = _LinearCEResult()
        _check(self._lib.kiln_linear_ce_compute(self._h, C.byref(p), C.byref(r)))
        self.last = {"loss_f64": r.loss_f64, "n_supervised": r.n_supervised,
                     "scratch_bytes": r.scratch_bytes}
        return r.loss
