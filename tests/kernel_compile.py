"""Compile every Triton kernel for a CUDA target (sm_90) without a GPU: TTIR -> PTX -> cubin
with the ptxas the triton wheel ships. Run as a script (triton must not be in interpreter
mode); prints one line per kernel and dtype, exits non-zero if any fails."""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "compile in a process without the interpreter"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from loraplex.kernels import (  # noqa: E402
    triton_bgmv_expand,
    triton_bgmv_shrink,
    triton_paged_attention,
    triton_sgmv_expand,
    triton_sgmv_shrink,
)


def source(kernel, pointers: dict[str, str], constexprs: dict) -> ASTSource:
    names = kernel.arg_names
    signature = {
        n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names
    }  # every argument not named is an int32 scalar (sizes, strides)
    consts = {(names.index(k),): v for k, v in constexprs.items()}
    return ASTSource(fn=kernel, signature=signature, constexprs=consts)


def cases(dt: str):
    seg = {"seg_start_ptr": "*i32", "seg_len_ptr": "*i32", "seg_slot_ptr": "*i32"}
    expand = {"t_rank_ptr": "*i32", "t_hoff_ptr": "*i32", "b_rows_ptr": "*i64",
              "cols_ptr": "*i32", "scales_ptr": "*fp32"}  # fmt: skip
    fp32 = dt == "fp32"
    yield triton_sgmv_shrink._sgmv_shrink_kernel, {
        "x_ptr": f"*{dt}", "arena_ptr": f"*{dt}", "h_ptr": "*fp32", "ranks_ptr": "*i32",
        "a_rows_ptr": "*i64", **seg,
    }, {"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_K": 32, "DOT_F32": fp32}  # fmt: skip
    yield triton_sgmv_expand._sgmv_expand_kernel, {
        "y_ptr": f"*{dt}", "h_ptr": "*fp32", "arena_ptr": f"*{dt}", **seg, **expand,
    }, {"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_N": 64, "DOT_F32": fp32}  # fmt: skip
    yield triton_bgmv_shrink._bgmv_shrink_kernel, {
        "x_ptr": f"*{dt}", "arena_ptr": f"*{dt}", "h_ptr": "*fp32", "token_slot_ptr": "*i32",
        "ranks_ptr": "*i32", "a_rows_ptr": "*i64",
    }, {"BLOCK_R": 16, "BLOCK_K": 64}  # fmt: skip
    yield triton_bgmv_expand._bgmv_expand_kernel, {
        "y_ptr": f"*{dt}", "h_ptr": "*fp32", "arena_ptr": f"*{dt}", "token_slot_ptr": "*i32",
        **expand,
    }, {"BLOCK_R": 16, "BLOCK_N": 64}  # fmt: skip
    yield triton_paged_attention._paged_decode_kernel, {
        "out_ptr": f"*{dt}", "q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}",
        "block_tables_ptr": "*i64", "ctx_lens_ptr": "*i32", "scale": "fp32",
    }, {"BLOCK_T": 16, "BLOCK_D": 128}  # fmt: skip


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    failed = 0
    for dt in ("fp32", "fp16", "bf16"):
        for kernel, pointers, constexprs in cases(dt):
            name = kernel.fn.__name__
            try:
                compiled = triton.compile(source(kernel, pointers, constexprs), target=target)
                print(f"{dt} {name}: {len(compiled.asm['cubin'])} bytes of sm_90 cubin")
            except Exception as e:  # noqa: BLE001 (report every kernel, then fail)
                failed += 1
                print(f"{dt} {name}: FAILED {e!r}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
