"""The `triton` backend: moekit's own fused FP8 MoE kernels (kernels in _kernels.py).

One layer call is, on the GPU and without a host synchronisation (so it captures into a CUDA graph):
  1. align: pairs grouped by expert, each group padded to BLOCK_M (1 launch at decode, 3 beyond)
  2. quantize x by the scheme's activation rule (1 launch; 2 for a dynamic per-tensor scale)
  3. GEMM1, rows gathered through the sorted pair ids, SiLU(gate) * up in the epilogue
  4. GEMM2, the intermediate quantized while it is loaded, top-k weight in the epilogue
  5. combine each token's K rows in a fixed order (deterministic)
A config with GEMV=1 or 2 runs the GEMV path instead (gemv.py: no alignment, no combine pass).
A call of more than MAX_ALIGN_PAIRS (token, expert) pairs (2**18: M = 32,768 tokens at top-8) runs
as consecutive calls on slices of its tokens (TritonBackend._run_in_chunks).
On Hopper each of these kernels is launched to overlap the end of the one before it (programmatic
dependent launch, MOEKIT_PDL: see pdl_enabled and _kernels._pdl_release).

The GEMM2 input of fp8-channel-token is quantized per 1x128 group of the intermediate rather than
per row: each 128-column group gets its own scale, so no element is quantized more coarsely than
a per-row scale would (the group's max is at most the row's), and it fuses into GEMM2's loads.
With MOEKIT_FP8_ACCUMULATION=fast it is quantized per row instead (vLLM's numerics, the
reference's rule), in a pass of its own between the GEMMs: group scales change with each K step,
so GEMM2 must scale and add every step's product into float32 itself, which is exactly the
promotion `fast` gives up; one scale per row is applied once, after GEMM2's loop.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from ... import env
from ...accumulation import FP8_ACCUMULATION_ENV, FP8_ACCUMULATIONS, fp8_accumulation  # noqa: F401 - re-exported
from ...spec import MoEShape, QuantScheme
from ...weights import MoEWeights
from ..base import Backend, device_capability
from ..compile_only import launch as launch_or_compile
from ..sizes import cdiv, next_pow2
from ..triton_options import ASSERT_OPTIONS, compile_options
from . import _kernels as k
from .config import KernelConfig, get_config

try:  # Gluon (Triton 3.4+): the overlapped GEMMs of KernelConfig.OVERLAP / OVERLAP2, Hopper only
    from . import _gluon_kernels as gk
except ImportError:
    gk = None

SINGLE_ALIGN_MAX_PAIRS = 128  # up to this many pairs, one program aligns them all
CHUNK = 128  # pairs per program of the multi-program alignment
E_BLOCK = 64  # experts handled at once when counting
SCAN_E_BLOCK = 16  # experts of one program of the scan over the per-chunk counts

# The most chunks the multi-program alignment's scan (_kernels.align_scan_kernel) takes: it reads
# every chunk's counts of SCAN_E_BLOCK experts in one [next_power_of_2(chunks), SCAN_E_BLOCK] int32
# tile, and Triton's cumsum stages that tile in shared memory, 32 bytes per chunk (compiled for
# sm_89 and sm_90, triton 3.6 and 3.9; a CPU test compiles it): 2048 chunks take 64 KiB, 4096 would
# take 128 KiB (over the 99 KiB of an sm_89 GPU's block), 8192 256 KiB (over Hopper's 227 KiB).
# (Triton's tile limit, TRITON_MAX_TENSOR_NUMEL = 2**20 elements, alone would allow 65536.)
SCAN_MAX_CHUNKS = 2048
# The most (token, expert) pairs one call aligns: 262,144 (M = 32,768 tokens at top-8). Beyond
# it, run() processes the tokens in consecutive slices of at most this many pairs, each a normal
# call (_run_in_chunks).
MAX_ALIGN_PAIRS = CHUNK * SCAN_MAX_CHUNKS


# Precise mode's promotion interval: the tensor cores' FP8 sums of at most this many products
# are added into float32 (_kernels._dot), whatever the K step, so a tile's K step does not change
# the sums (a step of 256 is two promotions, in the order two steps of 128 make them)
PROMOTE_EVERY = 128


def fp8_promote(cfg: KernelConfig) -> int:
    """The kernels' PROMOTE argument (see _kernels._dot): K elements between promotions, 0 for none."""
    return 0 if fp8_accumulation() == "fast" else min(cfg.BLOCK_K, PROMOTE_EVERY)


def _row_intermediate(scheme: QuantScheme) -> bool:
    """Whether the intermediate gets one scale per row (module docstring): per-token schemes in
    fast accumulation mode."""
    return scheme.is_fp8 and scheme.activation == "token" and not scheme.static_activation \
        and fp8_accumulation() == "fast"


def _joined(scheme: QuantScheme, cfg: KernelConfig) -> int:
    """GEMM1's JOIN argument: the config's, and 1 in fast mode for FP8 tiles of 64+ rows where
    the scheme allows it. Measured on an H200 (BENCHMARKS.md, fifth session), fast mode: never
    slower and up to 5% faster per layer (Mixtral-8x7B M = 4096: 2815 against 2955 µs); with the
    FP8 promotion of precise mode the same tile was 2.4x slower (fourth session)."""
    if cfg.JOIN:
        return 1
    per_step_scales = scheme.activation == "group" or scheme.weight == "block"
    return int(scheme.is_fp8 and not per_step_scales and cfg.BLOCK_M >= 64 and fp8_accumulation() == "fast")


def _interpreting() -> bool:
    return env.interpreting()  # one rule for every module (exactly "1")


# Programmatic dependent launch (MOEKIT_PDL, on by default where it exists: Hopper and newer, a
# Triton with griddepcontrol): each kernel of a layer starts while the one before it finishes and
# waits on the device for its writes (_kernels._pdl_enter), instead of being launched only after
# it. At decode sizes a layer is a few short kernels, so the gaps between them are a large share.
PDL_ENV = "MOEKIT_PDL"


def pdl_wanted() -> bool:
    """MOEKIT_PDL as asked for (ValueError for a value other than 1 or 0). Read at every launch;
    parsed once per value."""
    return _parse_pdl(env.get(PDL_ENV))


@functools.lru_cache(maxsize=8)
def _parse_pdl(raw: str | None) -> bool:
    value = (raw or "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{PDL_ENV}={raw!r}: expected 1 (on, the default where the GPU has it) or 0 (off)")
    return value != "0"


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels launched on `device` use it: wanted, and the GPU and Triton have it."""
    if not pdl_wanted() or device.type != "cuda" or _interpreting() or k.gdc_wait is None:
        return False
    capability = device_capability(device)
    return capability is not None and capability >= (9, 0)


def _launch(kernel, grid, *args, **kwargs):
    names = getattr(kernel, "arg_names", ())
    if "CHECK_IDS" in names:  # it reads the routing first: it asserts every id is in range
        kwargs["CHECK_IDS"] = True
        if not _interpreting():  # the interpreter takes no compile options (tests set its own debug)
            kwargs.update(ASSERT_OPTIONS)
    kwargs.update(compile_options(_interpreting()))  # FP fusion asked for by name (triton_options)
    if "PDL" in names:  # it waits for its predecessor itself: launch it early
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        kwargs["PDL"] = pdl_enabled(device)
        if kwargs["PDL"]:
            kwargs["launch_pdl"] = True
    launch_or_compile(kernel, grid, *args, **kwargs)  # or compile only (compile_only.py)


@functools.lru_cache(maxsize=16)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
A_SCALE_KIND = {None: 0, "tensor": 1, "token": 2, "group": 3}
B_SCALE_KIND = {None: 0, "tensor": 1, "channel": 2, "block": 3}


class TritonBackend(Backend):
    name = "triton"
    description = "moekit's fused Triton kernels (GPU-side alignment, fused SiLU, deterministic combine)"
    checks_expert_ids = True  # every path's first kernel to read topk_ids asserts them (CHECK_IDS)
    # int32 or int64 ids: Triton compiles each kernel for the pointer's type, and every comparison
    # with an expert index (the check included) is made in that type, so 2**32 + 3 is out of range
    reads_int64_ids = True

    def supports(self, shape: MoEShape, scheme: QuantScheme, device: torch.device, dtype=torch.bfloat16):
        # TRITON_INTERPRET set after import: every launch step would raise it (env.interpreting);
        # refused here, by name, so that auto and the backends that launch no Triton kernel still run
        late = env.interpreter_set_late()
        reasons = [late] if late is not None else []
        if device.type == "cuda":
            cap = device_capability(device)
            need = (8, 9) if scheme.is_fp8 else (8, 0)
            if cap is not None and cap < need:
                reasons.append(
                    f"{scheme.name} needs compute capability {need[0]}.{need[1]}+"
                    f"{' (FP8 tensor cores)' if scheme.is_fp8 else ''}, found {cap[0]}.{cap[1]}"
                )
        elif device.type == "cpu":
            if late is None and not _interpreting():
                reasons.append("on the CPU the Triton kernels run only under TRITON_INTERPRET=1")
        else:
            reasons.append(f"needs a CUDA GPU (or the CPU interpreter), got device {device.type}")
        if dtype not in (torch.bfloat16, torch.float16):
            reasons.append(f"activations must be bfloat16 or float16, got {dtype}")
        if shape.hidden % 16 or shape.n % 16:
            # every real model's are; the kernels mask their loads (other sizes ran right under the
            # interpreter) but have run on a GPU only at such sizes (README, known issues)
            reasons.append(f"hidden ({shape.hidden}) and intermediate per GPU ({shape.n}) must be multiples of 16 "
                           "(the sizes the kernels are checked at on a GPU)")
        return reasons

    @staticmethod
    def accuracy_class(scheme: QuantScheme) -> str:
        """moekit.check's threshold class: FP8 sums left to the tensor cores in fast mode."""
        return "kernel-fast" if scheme.is_fp8 and fp8_accumulation() == "fast" else "kernel"

    @staticmethod
    def intermediate_granularity(scheme: QuantScheme) -> str | None:
        """How GEMM2's input is quantized (moekit.check compares this backend with the float64
        problem of this rule): see the module docstring."""
        if not scheme.is_fp8 or scheme.static_activation or scheme.activation not in ("token", "group"):
            return None
        return "token" if _row_intermediate(scheme) else "group"

    def config_for(self, weights: MoEWeights, top_k: int, num_tokens: int, device: torch.device) -> KernelConfig:
        name = _device_name(device.index or 0) if device.type == "cuda" else None
        return get_config(weights.shape(top_k), weights.scheme, num_tokens, name)

    def compile_ahead(self, x, weights, topk_weights, topk_ids):
        """Its launch code, every launch compiled rather than run (inside compile_only())."""
        self.run(x, weights, topk_weights, topk_ids)
        return True

    def run(self, x, weights, topk_weights, topk_ids, config: KernelConfig | None = None):
        M, K = topk_ids.shape
        if M * K > MAX_ALIGN_PAIRS:
            return self._run_in_chunks(x, weights, topk_weights, topk_ids, config)
        return self._run(x, weights, topk_weights, topk_ids, config)

    def _run(self, x, weights, topk_weights, topk_ids, config: KernelConfig | None, out=None):
        """One call of at most MAX_ALIGN_PAIRS pairs; `out`: the [M, H] tensor to write (else a new one)."""
        M, K = topk_ids.shape
        topk_ids = topk_ids.contiguous()  # every path reads it flat (no copy where it already is)
        cfg = config or self.config_for(weights, K, M, x.device)
        _check_config(cfg, weights)
        if cfg.GEMV:
            from .gemv import run_gemv  # imported here: gemv.py imports this module

            y = run_gemv(x, weights, topk_weights, topk_ids, cfg, row_intermediate=_row_intermediate(weights.scheme))
            return y if out is None else out.copy_(y)
        if M * K <= SINGLE_ALIGN_MAX_PAIRS and _row_quant_mode(weights.scheme) is not None:
            align, a, a_scale = align_and_quantize(x, weights, topk_ids, cfg.BLOCK_M)
        else:
            align = align_pairs(topk_ids, weights.num_experts, cfg.BLOCK_M)
            a, a_scale = quantize_input(x, weights)
        act = gemm1(a, a_scale, weights, align, K, x.dtype, cfg)
        pairs = gemm2(act, weights, align, topk_weights, x.dtype, cfg)
        return combine(pairs, M, K, out)

    def _run_in_chunks(self, x, weights, topk_weights, topk_ids, config: KernelConfig | None):
        """More than MAX_ALIGN_PAIRS pairs: the tokens in as few consecutive slices as hold at most
        MAX_ALIGN_PAIRS pairs each, their sizes differing by at most one row, each slice a normal
        call (_run) writing its rows of the output, in order. Every token's output is computed as
        in a call of its slice alone, so the result is deterministic; it equals one call's bitwise
        where the slices run one call's config, except under a dynamic per-tensor activation scale
        (fp8-tensor-dynamic), whose scales (input and intermediate) are then one per slice.
        Without `config`, each slice looks up the config of its own M (config_for: the tuned
        entry nearest its batch size, else the analytic default by rows per expert). Slices hold
        at least about MAX_ALIGN_PAIRS / 2 = 2**17 pairs (16,384 tokens at top-8), beyond the batch
        sizes tables measure (8192 at most in the shipped ones), so they find the entry one call's
        M would; without a table, the default's largest regime (512+ rows per expert) holds for up
        to 256 experts."""
        M, K = topk_ids.shape
        slices = cdiv(M, max(1, MAX_ALIGN_PAIRS // K))
        rows, longer = divmod(M, slices)  # the first `longer` slices get rows + 1
        out = torch.empty(M, weights.hidden, dtype=x.dtype, device=x.device)
        end = 0
        for index in range(slices):
            begin, end = end, end + rows + (index < longer)
            self._run(x[begin:end], weights, topk_weights[begin:end], topk_ids[begin:end], config, out[begin:end])
        return out

    def prepare_gemm_only(self, x, weights, topk_weights, topk_ids, config: KernelConfig | None = None):
        """A closure running only the two expert GEMMs (SiLU fused in GEMM1) on inputs already
        aligned and quantized: what `moekit bench --mode gemm` and the tuner time."""
        M, K = topk_ids.shape
        topk_ids = topk_ids.contiguous()  # every path reads it flat (no copy where it already is)
        cfg = config or self.config_for(weights, K, M, x.device)
        _check_config(cfg, weights)
        a, a_scale = quantize_input(x, weights)
        tw = topk_weights.float()
        if cfg.GEMV:  # its GEMM2 holds the combine, which the tiled closure leaves out (not comparable)
            from .gemv import gemv_gemms

            row = _row_intermediate(weights.scheme)
            return lambda: gemv_gemms(a, a_scale, weights, tw, topk_ids, x.dtype, cfg, row_intermediate=row)
        align = align_pairs(topk_ids, weights.num_experts, cfg.BLOCK_M)

        def run_gemms():
            act = gemm1(a, a_scale, weights, align, K, x.dtype, cfg)
            return gemm2(act, weights, align, tw, x.dtype, cfg)

        return run_gemms


def _check_config(cfg: KernelConfig, weights: MoEWeights) -> None:
    """ValueError naming why `cfg` cannot run these weights' scheme (KernelConfig.problems), or
    their intermediate size where GEMM2 keeps its activations (KEEP_A2): the launch steps below,
    the Gluon kernels' included, assume a config that passed it."""
    problems = _config_problems(cfg, weights.scheme)
    if problems:
        raise ValueError(f"kernel config {cfg} cannot run {weights.scheme.name}: {'; '.join(problems)}")
    _keep_a_steps(_gemm2_launch(cfg), weights.n)  # GEMM2's K step


@functools.lru_cache(maxsize=1024)
def _config_problems(cfg: KernelConfig, scheme: QuantScheme) -> tuple[str, ...]:
    """cfg.problems(scheme), remembered: it runs on every layer call, and for a config with a
    GEMM2 launch of its own it took 27 µs of host time (both values are frozen dataclasses)."""
    return tuple(cfg.problems(scheme))


@functools.lru_cache(maxsize=1024)
def _gemm2_launch(cfg: KernelConfig) -> KernelConfig:
    """cfg.gemm2(), remembered (12 µs of host time per layer call for such a config)."""
    return cfg.gemm2()


# --------------------------------------------------------------------------- launch steps


class Alignment:
    """Result of align_pairs: `sorted_pairs[row]` is the pair at a sorted row; expert e owns rows
    [start[e], start[e+1]) whose first count[e] are real; `max_rows` bounds start[E] for any routing."""

    def __init__(self, sorted_pairs, count, start, max_rows, num_pairs):
        self.sorted_pairs, self.count, self.start = sorted_pairs, count, start
        self.max_rows, self.num_pairs = max_rows, num_pairs


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    if topk_ids.numel() > MAX_ALIGN_PAIRS:  # run() splits such calls; Triton would refuse the scan's tile
        raise ValueError(f"{topk_ids.numel()} (token, expert) pairs: one alignment takes at most "
                         f"{MAX_ALIGN_PAIRS} (launch.MAX_ALIGN_PAIRS); TritonBackend.run splits larger calls")
    align = _empty_alignment(topk_ids, num_experts, block_m)
    P, E, ids, dev = align.num_pairs, num_experts, topk_ids.reshape(-1), topk_ids.device
    sorted_pairs, count, start = align.sorted_pairs, align.count, align.start
    if P <= SINGLE_ALIGN_MAX_PAIRS:
        _launch(k.align_single_kernel, (1,),
            ids, sorted_pairs, count, start, P, E,
            BLOCK_M=block_m, CHUNK=SINGLE_ALIGN_MAX_PAIRS, E_BLOCK=E_BLOCK,
        )
    else:
        chunks = cdiv(P, CHUNK)
        chunk_counts = torch.empty(chunks, E, dtype=torch.int32, device=dev)
        total = torch.empty(E, dtype=torch.int32, device=dev)
        _launch(k.align_count_kernel, (chunks,), ids, chunk_counts, P, E, CHUNK=CHUNK, E_BLOCK=E_BLOCK)
        scan_programs = cdiv(E, SCAN_E_BLOCK)
        _launch(k.align_scan_kernel, (scan_programs,),
            chunk_counts, total, count, start, chunks, E,
            BLOCK_M=block_m, C_POW2=next_pow2(chunks), E_BLOCK=SCAN_E_BLOCK, WITH_STARTS=scan_programs == 1,
        )
        if scan_programs > 1:
            _launch(k.align_starts_kernel, (1,), total, count, start, E, BLOCK_M=block_m, E_BLOCK=E_BLOCK)
        _launch(k.align_scatter_kernel, (chunks,), ids, sorted_pairs, chunk_counts, start, P, E, CHUNK=CHUNK)
    return align


def _empty_alignment(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    P, E, dev = topk_ids.numel(), num_experts, topk_ids.device
    # every non-empty expert wastes at most block_m - 1 rows; at most min(E, P) are non-empty
    max_rows = P + min(E, P) * (block_m - 1)
    return Alignment(
        torch.empty(max_rows, dtype=torch.int32, device=dev),
        torch.empty(E, dtype=torch.int32, device=dev),
        torch.empty(E + 1, dtype=torch.int32, device=dev),
        max_rows, P,
    )


def _row_quant_mode(scheme: QuantScheme) -> int | None:
    """quantize_rows_kernel's MODE for schemes quantized row by row (None otherwise)."""
    if not scheme.is_fp8:
        return None
    if scheme.static_activation:
        return 3
    return {"token": 0, "group": 1}.get(scheme.activation)


def _input_scale(x: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
    M, H = x.shape
    if weights.scheme.static_activation:
        return weights.a13_scale
    if weights.scheme.activation == "token":
        return torch.empty(M, dtype=torch.float32, device=x.device)
    if weights.scheme.activation == "group":
        return torch.empty(M, cdiv(H, 128), dtype=torch.float32, device=x.device)
    return torch.empty(1, dtype=torch.float32, device=x.device)


def _block_h(H: int) -> int:
    return next_pow2(max(H, 128))


# Columns of x per quantizing program where a row's scale needs no more than them (1x128 groups,
# per-tensor scales): at decode sizes one program per row leaves all SMs but M idle while each
# works through its row. On an H100 chunks of 1024 made the quantize launch alone 0.4-0.6 µs
# faster at DeepSeek-V3's 7168 columns, M = 1-64 (the layer did not move beyond its spread;
# BENCHMARKS.md, thirty-first session). 0: the whole row per program, as before.
QUANTIZE_CHUNK = 1024


def _quantize_columns(H: int, mode: int | None) -> int:
    """BLOCK_H of quantize_rows_kernel / decode_prologue_kernel: the whole row (a power of two) for
    a per-row scale (MODE 0: the row's |max|), else at most QUANTIZE_CHUNK."""
    chunk = QUANTIZE_CHUNK
    if chunk and (chunk < 128 or chunk & (chunk - 1)):  # a tile of whole 128-groups, a power of two
        raise ValueError(f"launch.QUANTIZE_CHUNK must be 0 or a power of two >= 128, got {chunk!r}")
    whole = _block_h(H)
    return whole if mode == 0 or not chunk else min(whole, chunk)


def quantize_input(x: torch.Tensor, weights: MoEWeights) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x -> (FP8 x, scales) by the scheme's activation rule; unquantized schemes pass x through."""
    scheme = weights.scheme
    x = x.contiguous()  # every kernel reads rows of x with unit stride, unquantized ones included
    if not scheme.is_fp8:
        return x, None
    M, H = x.shape
    q = torch.empty(M, H, dtype=torch.float8_e4m3fn, device=x.device)
    scale = _input_scale(x, weights)
    mode = _row_quant_mode(scheme)
    columns = _quantize_columns(H, mode)
    launch = functools.partial(
        _launch, k.quantize_rows_kernel, (M, cdiv(H, columns)), x, q, scale, H=H, stride_x=x.stride(0),
        stride_q=q.stride(0), stride_s=scale.stride(0) if scale.dim() == 2 else 0, BLOCK_H=columns, GROUP=128,
        INTERPRET=_interpreting(),
    )
    if mode is not None:
        launch(amax_ptr=scale, MODE=mode, FROM_AMAX=False)
    else:  # one dynamic scale for the whole tensor: a max pass, then the quantizing pass
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        launch(amax_ptr=amax, MODE=2, FROM_AMAX=False)
        launch(amax_ptr=amax, MODE=3, FROM_AMAX=True)
    return q, scale


def align_and_quantize(x, weights: MoEWeights, topk_ids, block_m: int):
    """align_pairs and quantize_input in one launch (decode sizes, row-wise schemes)."""
    M, H = x.shape
    x = x.contiguous()
    align = _empty_alignment(topk_ids, weights.num_experts, block_m)
    q = torch.empty(M, H, dtype=torch.float8_e4m3fn, device=x.device)
    scale = _input_scale(x, weights)
    mode = _row_quant_mode(weights.scheme)
    columns = _quantize_columns(H, mode)
    chunks = cdiv(H, columns)
    _launch(k.decode_prologue_kernel, (1 + M * chunks,),
        topk_ids.reshape(-1), align.sorted_pairs, align.count, align.start, align.num_pairs,
        weights.num_experts, x, q, scale, H, x.stride(0), q.stride(0),
        scale.stride(0) if scale.dim() == 2 else 0, chunks,
        BLOCK_M=block_m, CHUNK=SINGLE_ALIGN_MAX_PAIRS, E_BLOCK=E_BLOCK,
        MODE=mode, BLOCK_H=columns, GROUP=128, INTERPRET=_interpreting(),
    )
    return align, q, scale


# GEMM1's last column block at half width where it holds at most half a tile of real columns
# (_kernels.gemm1_kernel); a switch for diagnostics (scripts/diag_half_tail.py) and tests.
HALF_WIDTH_TAIL = True


# The 128-row Gluon GEMM1 running an expert's last block at 64 rows when it holds at most 64
# (_gluon_kernels.gemm1_overlap_tall_kernel's HALF_HEIGHT), as _kernels._half_tile does for the
# Triton kernels. Off: on an H200 (BENCHMARKS.md, nineteenth session) bitwise the full-height
# tile, but no clear win (1.5-3% less time at Qwen3-30B-A3B M = 4096 and Mixtral M = 1024, 0.3-0.9%
# more at DeepSeek-V3 M = 4096 / 8192). The GPU tests run it on and off, and
# scripts/diag_half_tail.py --switch gluon-half-height times it on against off.
GLUON_HALF_HEIGHT = False


def _half_tail(width: int, block_n: int, joined: int) -> int:
    """GEMM1's HALF_TAIL argument: 1 when the last of the `block_n`-wide column blocks covering
    `width` holds at most block_n // 2 real columns, the tile is not JOIN's, and the half is
    still 16+ wide (tl.dot's least)."""
    tail = width % block_n
    return int(HALF_WIDTH_TAIL and not joined and block_n >= 32 and 0 < tail <= block_n // 2)


def _tiles(align: Alignment, cfg: KernelConfig, width: int, tiles_per_program: int = 1) -> tuple[int]:
    """The grid: programs for every row block the worst routing can fill, times the runs of
    `tiles_per_program` column tiles that cover `width`."""
    column_tiles = cdiv(width, cfg.BLOCK_N)
    return (cdiv(align.max_rows, cfg.BLOCK_M) * cdiv(column_tiles, tiles_per_program),)


def _scale_strides(scale: torch.Tensor | None) -> tuple[int, int]:
    """Strides of a weight-scale tensor along experts and rows (its last dim is contiguous)."""
    if scale is None:
        return 0, 0
    return scale.stride(0), (scale.stride(1) if scale.dim() > 2 else 0)


class Intermediate:
    """GEMM1's output in sorted-row order, and how GEMM2 reads it (gemm2_kernel's A_MODE)."""

    def __init__(self, values, scale, a_mode):
        self.values, self.scale, self.a_mode = values, scale, a_mode


def _tiled_only(cfg: KernelConfig) -> None:
    if cfg.GEMV:
        raise ValueError(f"{cfg} is a config of the GEMV path (gemv.py); the tiled kernels cannot run it")


def gemm1(a, a_scale, weights: MoEWeights, align: Alignment, top_k: int, out_dtype, cfg: KernelConfig) -> Intermediate:
    """Rows of a gathered by expert, times w13, SiLU(gate) * up, then the intermediate's own
    quantization where it can be fused here (static scale; 1x128 groups when a tile holds whole
    groups); otherwise GEMM2 quantizes it while loading."""
    _tiled_only(cfg)
    scheme = weights.scheme
    E, N, H = weights.num_experts, weights.n, weights.hidden
    dev = a.device
    fp8 = torch.float8_e4m3fn
    if not scheme.is_fp8:
        out_mode, a_mode, scale, out = 0, 0, None, torch.empty(align.max_rows, N, dtype=out_dtype, device=dev)
    elif scheme.static_activation:
        out_mode, a_mode, scale = 2, 1, weights.a2_scale
        out = torch.empty(align.max_rows, N, dtype=fp8, device=dev)
    elif scheme.activation == "tensor":  # one dynamic scale: GEMM1 records the max, GEMM2 quantizes
        out_mode, a_mode, scale = 1, 3, torch.zeros(1, dtype=torch.float32, device=dev)
        out = torch.empty(align.max_rows, N, dtype=out_dtype, device=dev)
    elif _row_intermediate(scheme):  # bf16 here, one scale per row in its own pass (docstring)
        out_mode, a_mode, scale = 0, 5, None
        out = torch.empty(align.max_rows, N, dtype=out_dtype, device=dev)
    elif cfg.BLOCK_N == 128:  # token and group rules: a tile row is one 1x128 group (module docstring)
        out_mode, a_mode = 3, 4
        out = torch.empty(align.max_rows, N, dtype=fp8, device=dev)
        scale = torch.empty(align.max_rows, cdiv(N, 128), dtype=torch.float32, device=dev)
    else:
        out_mode, a_mode, scale = 0, 2, None
        out = torch.empty(align.max_rows, N, dtype=out_dtype, device=dev)
    w_scale = weights.w13_scale
    unused = a  # pointer arguments a variant never reads
    stride_wse, stride_wsn = _scale_strides(w_scale)
    stride_as = a_scale.stride(0) if a_scale is not None and a_scale.dim() == 2 else 1  # per 1x128 group: its row
    if _overlapped(cfg, out_mode, H, dev, a, weights.w13):
        tall = cfg.BLOCK_M == 128
        rows = dict(HALF_HEIGHT=int(GLUON_HALF_HEIGHT)) if tall else {}
        _launch(gk.gemm1_overlap_tall_kernel if tall else gk.gemm1_overlap_kernel, _tiles(align, cfg, N),
            a, a_scale, weights.w13, w_scale, out, scale, align.sorted_pairs, align.count, align.start,
            E, N, H, top_k,
            a.stride(0), stride_as,
            weights.w13.stride(0), weights.w13.stride(1), stride_wse, stride_wsn, out.stride(0), scale.stride(0),
            A_SCALE=A_SCALE_KIND[scheme.activation], B_SCALE=B_SCALE_KIND[scheme.weight],
            ACT_DTYPE=_TL_DTYPE[out_dtype], E_POW2=next_pow2(E),
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
            STAGES=cfg.num_stages, num_warps=cfg.num_warps, **rows,
        )
        return Intermediate(out, scale, a_mode)
    joined = _joined(scheme, cfg)
    _launch(k.gemm1_kernel, _tiles(align, cfg, N),
        a, a_scale if a_scale is not None else unused, weights.w13,
        w_scale if w_scale is not None else unused, out,
        scale if scale is not None else unused, scale if scale is not None else unused,
        align.sorted_pairs, align.count, align.start,
        align.num_pairs, E, N, H, top_k,
        a.stride(0), stride_as,
        weights.w13.stride(0), weights.w13.stride(1), stride_wse, stride_wsn, out.stride(0),
        scale.stride(0) if scale is not None and scale.dim() == 2 else 0,
        A_SCALE=A_SCALE_KIND[scheme.activation] if scheme.is_fp8 else 0,
        B_SCALE=B_SCALE_KIND[scheme.weight],
        OUT_MODE=out_mode, ACT_DTYPE=_TL_DTYPE[out_dtype], E_POW2=next_pow2(E),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, PROMOTE=fp8_promote(cfg),
        JOIN=joined, HALF_TAIL=_half_tail(N, cfg.BLOCK_N, joined),
        INTERPRET=_interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if a_mode == 5:
        return quantize_intermediate_rows(out, align, E)
    return Intermediate(out, scale, a_mode)


def _overlapped(cfg: KernelConfig, out_mode: int, H: int, device: torch.device,
                a: torch.Tensor | None = None, w13: torch.Tensor | None = None) -> bool:
    """Whether GEMM1 runs a Gluon kernel (_gluon_kernels.gemm1_overlap_kernel on 64 rows,
    gemm1_overlap_tall_kernel on 128) for a config with OVERLAP = 1 (KernelConfig.problems has checked scheme, tile and stages): where its
    promotion exists (the intermediate quantized per 1x128 group, OUT_MODE 3: not in fast mode's
    per-row rule for per-token schemes, where the tensor cores sum all of K), on a Hopper GPU
    (wgmma; never under the interpreter, which runs the Triton kernel it mirrors), with K in whole
    steps, at least as many steps as the pipeline preloads, and 16-byte aligned rows of `a` and
    `w13` (its 16-byte cp.async copies). Elsewhere the Triton kernel runs the same tile (in fast
    mode, for a per-token scheme, as its joined tile: _joined), bitwise the same result
    (tests/test_triton_overlap.py)."""
    if not cfg.OVERLAP or out_mode != 3 or not overlap_available(device):
        return False
    return _fills_gluon_pipeline(cfg, H) and _rows_aligned16(a, w13)


def _overlapped2(cfg2: KernelConfig, a_mode: int, N: int, device: torch.device,
                 values: torch.Tensor | None = None, w2: torch.Tensor | None = None) -> bool:
    """Whether GEMM2 runs the Gluon kernel (_gluon_kernels.gemm2_overlap_kernel) for GEMM2's
    config `cfg2` with OVERLAP2 = 1 (KernelConfig.problems has checked scheme, tile and stages):
    where GEMM1 wrote an FP8 intermediate with 1x128 group scales (A_MODE 4: not fast mode's
    per-row rule, nor GEMM1 tiles narrower than 128), on a Hopper GPU, with the intermediate in
    whole K steps, at least as many as the pipeline preloads, and 16-byte aligned rows. Elsewhere
    the Triton kernel runs the same tile, bitwise the same result (tests/test_triton_overlap.py)."""
    if not cfg2.OVERLAP2 or a_mode != 4 or not overlap_available(device):
        return False
    return _fills_gluon_pipeline(cfg2, N) and _rows_aligned16(values, w2)


def _fills_gluon_pipeline(cfg: KernelConfig, K: int) -> bool:
    """Whether an inner dimension K suits a Gluon GEMM's pipeline under `cfg`: whole K steps (its
    loads have no K mask), at least as many as it preloads (num_stages - 1)."""
    return K % cfg.BLOCK_K == 0 and K // cfg.BLOCK_K >= cfg.num_stages - 1


def _rows_aligned16(*tensors: torch.Tensor | None) -> bool:
    """Whether each given tensor starts on a 16-byte boundary and its rows are a multiple of 16
    bytes apart (FP8: elements): the Gluon kernels' cp.async copies are 16 bytes wide."""
    return all(t is None or (t.data_ptr() % 16 == 0 and t.stride(-2) % 16 == 0) for t in tensors)


def overlap_available(device: torch.device) -> bool:
    """Whether the Gluon GEMMs can run on `device` at all: a Hopper GPU (wgmma), a Triton with
    Gluon, not the interpreter (the tuner asks this too)."""
    if gk is None or _interpreting() or device.type != "cuda":
        return False
    cap = device_capability(device)
    return cap is not None and cap[0] == 9


def quantize_intermediate_rows(values: torch.Tensor, align: Alignment, num_experts: int) -> Intermediate:
    """GEMM1's bf16/fp16 output -> FP8 with one scale per row (GEMM2's A_MODE 5), real rows only."""
    rows, N = values.shape
    q = torch.empty(rows, N, dtype=torch.float8_e4m3fn, device=values.device)
    scale = torch.empty(rows, dtype=torch.float32, device=values.device)
    block = _block_h(N)
    _launch(k.quantize_sorted_rows_kernel, (rows,),
        values, q, scale, align.count, align.start, num_experts, N, values.stride(0), q.stride(0),
        E_POW2=next_pow2(num_experts), BLOCK_H=block, INTERPRET=_interpreting(),
        num_warps=8 if block >= 8192 else 4,  # a whole row per program: 16K values at Mixtral's N
    )
    return Intermediate(q, scale, 5)


def gemm2(act: Intermediate, weights: MoEWeights, align: Alignment, topk_weights, out_dtype, cfg: KernelConfig):
    """Intermediate rows times w2 of their expert, times the pair's top-k weight, written to the
    pair's own row of a [P, H] buffer (no two programs write the same element: deterministic).
    Runs GEMM2's own tile width, warps, stages and grouping where the config sets them."""
    _tiled_only(cfg)
    cfg = _gemm2_launch(cfg)
    scheme = weights.scheme
    E, N, H = weights.num_experts, weights.n, weights.hidden
    values = act.values
    out = torch.empty(align.num_pairs, H, dtype=out_dtype, device=values.device)
    w_scale = weights.w2_scale
    stride_wse, stride_wsn = _scale_strides(w_scale)
    pair_weights = topk_weights.reshape(-1).contiguous()
    if _overlapped2(cfg, act.a_mode, N, values.device, values, weights.w2):
        _launch(gk.gemm2_overlap_kernel, _tiles(align, cfg, H),
            values, act.scale, weights.w2, w_scale, pair_weights, out,
            align.sorted_pairs, align.count, align.start, E, N, H,
            values.stride(0), act.scale.stride(0), weights.w2.stride(0), weights.w2.stride(1), stride_wse, stride_wsn,
            out.stride(0),
            B_SCALE=B_SCALE_KIND[scheme.weight], E_POW2=next_pow2(E),
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
            STAGES=cfg.num_stages, num_warps=cfg.num_warps,
        )
        return out
    _launch(k.gemm2_kernel, _tiles(align, cfg, H, cfg.gemm2_tiles),
        values, act.scale if act.scale is not None else values, weights.w2,
        w_scale if w_scale is not None else values, pair_weights, out,
        align.sorted_pairs, align.count, align.start,
        align.num_pairs, E, N, H,
        values.stride(0), act.scale.stride(0) if act.scale is not None else 0,  # (rows,) or (rows, groups)
        weights.w2.stride(0), weights.w2.stride(1), stride_wse, stride_wsn, out.stride(0),
        A_MODE=act.a_mode, B_SCALE=B_SCALE_KIND[scheme.weight], E_POW2=next_pow2(E),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
        N_TILES=cfg.gemm2_tiles, KEEP_A_STEPS=_keep_a_steps(cfg, N), PROMOTE=fp8_promote(cfg), INTERPRET=_interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _keep_a_steps(cfg: KernelConfig, n: int) -> int:
    """gemm2_kernel's KEEP_A_STEPS: the K steps of the intermediate's n columns a KEEP_A2 run
    holds, 0 without KEEP_A2; ValueError where n does not fit (KernelConfig.keep_a2_fits).
    `cfg`: GEMM2's launch (cfg.gemm2(), whose BLOCK_K is GEMM2's step)."""
    if not cfg.KEEP_A2:
        return 0
    problem = cfg.keep_a2_problem(n)
    if problem:
        raise ValueError(f"{problem} (use KEEP_A2=0)")
    return cdiv(n, cfg.BLOCK_K)


def combine(pairs: torch.Tensor, M: int, K: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's K pair rows summed into out [M, H] (new unless given: then contiguous rows)."""
    H = pairs.shape[1]
    if out is None:
        out = torch.empty(M, H, dtype=pairs.dtype, device=pairs.device)
    block_h = min(next_pow2(H), 1024)
    _launch(k.combine_kernel, (M, cdiv(H, block_h)), pairs, out, H, K_TOP=K, BLOCK_H=block_h, INTERPRET=_interpreting())
    return out
