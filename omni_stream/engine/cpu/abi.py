"""The CPU runtime's C interface (``omni_cpu.cpp``): ctypes mirrors of its structs, the library
with its argument types declared, and the one-pass SnakeBeta kernel Code2Wav's streaming decode
calls. Everything that calls into the runtime reaches it through here."""

from __future__ import annotations

import ctypes as C

import torch

from omni_stream.engine.cpu.build import ensure_library


class OcLinear(C.Structure):
    _fields_ = [("kind", C.c_int32), ("n", C.c_int32), ("k", C.c_int32), ("group", C.c_int32),
                ("w", C.c_void_p), ("scales", C.c_void_p), ("row_scale", C.c_void_p),
                ("row_sum", C.c_void_p), ("wf", C.c_void_p), ("bias", C.c_void_p)]

class OcLayer(C.Structure):
    _fields_ = [("qkv", OcLinear), ("o", OcLinear), ("gate_up", OcLinear), ("down", OcLinear),
                ("ln1", C.c_void_p), ("ln2", C.c_void_p), ("q_norm", C.c_void_p),
                ("k_norm", C.c_void_p)]

class OcStack(C.Structure):
    _fields_ = [("layers", C.c_int32), ("hidden", C.c_int32), ("heads", C.c_int32),
                ("kv_heads", C.c_int32), ("head_dim", C.c_int32), ("ffn", C.c_int32),
                ("eps", C.c_float), ("layer", C.POINTER(OcLayer)), ("norm", C.c_void_p)]

class OcCache(C.Structure):
    _fields_ = [("k", C.POINTER(C.c_void_p)), ("v", C.POINTER(C.c_void_p)), ("length", C.c_int32),
                ("bf16", C.c_int32)]

class OcSampling(C.Structure):
    _fields_ = [("greedy", C.c_void_p), ("top_k", C.c_void_p), ("temperature", C.c_void_p),
                ("top_p", C.c_void_p), ("seed", C.c_void_p), ("counter", C.c_void_p)]

class OcCodePredictor(C.Structure):
    _fields_ = [("stack", OcStack), ("cache", OcCache), ("heads", C.POINTER(OcLinear)),
                ("proj", C.POINTER(OcLinear)), ("talker_codec_emb", C.c_void_p),
                ("cp_emb", C.POINTER(C.c_void_p)), ("emb_bf16", C.c_int32),
                ("talker_hidden", C.c_int32), ("talker_vocab", C.c_int32),
                ("cp_vocab", C.c_int32), ("groups", C.c_int32), ("cos_tab", C.c_void_p),
                ("sin_tab", C.c_void_p)]


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()

def library(path: str | None = None) -> C.CDLL:
    """The runtime library with its argument types declared (``path``: another build)."""
    lib = C.CDLL(path) if path else ensure_library()
    if not getattr(lib, "_omni_typed", False):
        lib.oc_pool_create.restype = C.c_void_p
        lib.oc_pool_create.argtypes = [C.c_int32]
        lib.oc_pool_destroy.argtypes = [C.c_void_p]
        lib.oc_linear.argtypes = [C.c_void_p, C.POINTER(OcLinear), C.c_void_p, C.c_int32, C.c_void_p]
        lib.oc_stack_step.argtypes = [C.c_void_p, C.POINTER(OcStack), C.POINTER(OcCache), C.c_int32,
                                      C.c_void_p, C.c_void_p, C.c_void_p, C.c_void_p, C.c_void_p]
        lib.oc_sample.argtypes = [C.c_void_p, C.c_int32, C.c_int32, C.POINTER(OcSampling), C.c_void_p]
        lib.oc_code_predictor_frame.argtypes = [C.c_void_p, C.POINTER(OcCodePredictor), C.c_int32,
                                                C.c_void_p, C.c_void_p, C.POINTER(OcSampling),
                                                C.c_void_p]
        lib.oc_pool_create_lent.restype = C.c_void_p
        lib.oc_pool_create_lent.argtypes = [C.c_int32, C.c_int32, C.c_void_p]
        lib.oc_pool_set_lease.argtypes = [C.c_void_p, C.c_void_p]
        lib.oc_pool_jobs.argtypes = [C.c_void_p, C.POINTER(C.c_uint64), C.POINTER(C.c_uint64)]
        lib.oc_lease_acquire.restype = C.c_int32
        lib.oc_lease_acquire.argtypes = [C.c_void_p, C.c_int64]
        lib.oc_lease_release.argtypes = [C.c_void_p]
        lib.oc_has_amx.restype = C.c_int32
        lib.oc_isa.restype = C.c_char_p  # the kernel set, e.g. b"avx2+fma+f16c" (engine.cpu.isa)
        lib.oc_isa.argtypes = []
        lib.oc_isa_level.restype = C.c_int32  # isa.LEVELS' index
        lib.oc_isa_level.argtypes = []
        # the scalar reference's products (tests: every kernel set gives them bit for bit)
        lib.oc_linear_ref.argtypes = [C.POINTER(OcLinear), C.c_void_p, C.c_int32, C.c_void_p]
        lib.oc_kv_products.argtypes = [C.c_int32, C.c_void_p, C.c_void_p, C.c_int32, C.c_int32,
                                       C.c_int32, C.c_void_p, C.c_void_p, C.c_void_p]
        lib.oc_snake_bf16.argtypes = [C.c_void_p, C.c_void_p, C.c_void_p, C.c_void_p, C.c_int64,
                                      C.c_int32, C.c_int64]
        lib.oc_snake_bf16_ref.argtypes = lib.oc_snake_bf16.argtypes
        lib.oc_snake_f32.argtypes = lib.oc_snake_f32_ref.argtypes = lib.oc_snake_bf16.argtypes
        lib._omni_typed = True
    return lib


def snake_kernel(lib: C.CDLL | None = None):
    """Code2Wav's SnakeBeta in one pass (``oc_snake_bf16`` / ``oc_snake_f32``) as
    ``fn(x, alpha, inv_beta) -> y`` for bf16 or fp32 x [B, C, T] and fp32 per-channel alpha =
    exp(log alpha) and inv_beta = 1 / (exp(log beta) + 1e-9); for ``Code2Wav.pack(snake=...)``.
    Each value's result depends on it alone (kernels/scalar.h's snake_one, on every kernel set)."""
    lib = lib or library()
    fns = {torch.bfloat16: lib.oc_snake_bf16, torch.float32: lib.oc_snake_f32}

    def snake(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
        fn = fns.get(x.dtype)
        if fn is None or x.dim() != 3:
            raise ValueError(f"the snake kernel takes bf16 or fp32 [batch, channels, time], got {x.dtype} "
                             f"{tuple(x.shape)}")
        x = x.contiguous()
        y = torch.empty_like(x)
        fn(x.data_ptr(), y.data_ptr(), alpha.data_ptr(), inv_beta.data_ptr(), x.shape[0] * x.shape[1],
           x.shape[1], x.shape[2])
        return y

    return snake
