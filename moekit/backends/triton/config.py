"""Launch configuration of the triton backend: `KernelConfig`, analytic defaults, tuned tables.

One config serves both GEMMs (they share the row blocks of the alignment, so BLOCK_M is
common), except that GEMM2 may have a tile width, warps, stages, grouping and K step of its own
(BLOCK_N2, num_warps2, num_stages2, GROUP_M2, BLOCK_K2; 0 = GEMM1's): with its short inner dimension it
wanted 3 stages where GEMM1 wanted 4 at GLM-4.5V M = 8192 (621 against 865 µs for GEMM2 alone in
fast mode), and 256-wide tiles at Mixtral M = 4096 (754 against 863; BENCHMARKS.md, eighth
session). GEMM2's programs may also run several of a row block's column tiles in turn (N_TILES2,
_kernels._gemm2_row_run; GEMM2's grouping then does not apply): 4% faster per layer at DeepSeek-V3
M = 4096 (eleventh session), and GEMM2 may run in Gluon with its FP8 promotion overlapped (OVERLAP2,
_gluon_kernels.gemm2_overlap_kernel: 2.3-10% per layer at Mixtral-8x7B M = 512-8192, fifteenth
session), and its runs may keep their row block's activations where the intermediate fits six K
steps (KEEP_A2, _kernels._gemm2_resident_run: 2.7-9% per layer at DeepSeek-V3 TP8 M = 1024-8192
on an H100 with two steps, thirty-fourth session; at six, GLM-4.5V and Qwen3-30B-A3B, it lost,
thirty-fifth). The GEMV path's GEMM2 (one program per token and column block of the hidden size,
where GEMM1 has one per pair and column block of N) may take a column block and warps of its
own (BLOCK_N2, num_warps2; twenty-seventh session: the tuner's GEMM2 step times them,
space.GEMV_GEMM2_GRID says why; 2-3.5% per layer at GLM-4.5V and DeepSeek-V3 M = 2, twenty-eighth),
and a K-loop depth of its own (num_stages2; twenty-ninth session, space.gemv_gemm2_variants says why). BLOCK_N is the width of an output tile: GEMM1 computes BLOCK_N gate
and BLOCK_N up columns per tile, so its tile spans 2 * BLOCK_N columns of w13 (vLLM's
BLOCK_SIZE_N for the same tile is 2 * BLOCK_N).

Tuned tables (written by `moekit tune`, found through `moekit.tables`: the user's folders, then
the shipped ones) hold {"meta": {...}, "configs": {"<batch size>": {BLOCK_M: .., ..., "us": ..}}};
the tables found are layered (each answers within the range of sizes it measured, where no table
found before it does: _layered_table), and the entry of the nearest measured batch size (in log
space) is used; in fast accumulation mode, over the union of the fast-mode tables' sizes and the
precise tables' (fast entries first). An entry that is not a config, or whose config cannot run the
table's problem (entry_problems), is skipped with a warning naming the file, the size and why when
the table is read (load_table), so it takes no part in the nearest-size lookup or the layering.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from ...accumulation import table_accumulation
from ...spec import MoEShape, QuantScheme
from ... import tables
from ...tables import accumulation_mismatch, find_tables

log = logging.getLogger("moekit.triton")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    BLOCK_M: int = 64
    BLOCK_N: int = 64
    BLOCK_K: int = 128
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3
    JOIN: int = 0  # 1: GEMM1's gate and up columns in one wide tile (_kernels._gemm1_joined)
    # 1 or 2: the decode path of gemv.py (no alignment; BLOCK_M and GROUP_M unused), its GEMM1
    # reducing each K step (1) or once after the K loop (2; _gemv_kernels module docstring)
    GEMV: int = 0
    # 1: GEMM1 runs _gluon_kernels.gemm1_overlap_kernel (64 rows) or gemm1_overlap_tall_kernel
    # (128) on Hopper, which add each K step's FP8 product into float32 while the next product
    # runs (OVERLAP_TILE, OVERLAP_ROWS; launch.gemm1 says where)
    OVERLAP: int = 0
    # GEMM2's own launch parameters (0: the same as GEMM1's; module docstring); the GEMV path
    # takes BLOCK_N2, num_warps2 and num_stages2 (GEMV_GEMM2_FIELDS)
    BLOCK_N2: int = 0
    num_warps2: int = 0
    num_stages2: int = 0
    GROUP_M2: int = 0
    # GEMM2's own K step: where GEMM1's activations have one scale per token (not per 1x128 group),
    # GEMM1 may read K in wider steps than the 128 that GEMM2's 1x128-group intermediate ties it to
    # (KernelConfig._k_step_problems)
    BLOCK_K2: int = 0
    # GEMM2's column tiles per program (0 or 1: one): a program runs N_TILES2 column blocks of its
    # row block in turn (_kernels._gemm2_row_run); GEMM1 has no such parameter
    N_TILES2: int = 0
    # 1: GEMM2 runs _gluon_kernels.gemm2_overlap_kernel on Hopper, each K step's FP8 product
    # promoted while the next runs (OVERLAP2_TILES; launch.gemm2 says where); 0: the Triton kernel
    OVERLAP2: int = 0
    # 1: GEMM2's programs, running N_TILES2 > 1 column tiles each, load their row block's
    # activations once for the run (GEMM2's inner dimension N in at most six of its K steps: N <= 6 *
    # GEMM2's BLOCK_K, KEEP_A2_STEPS) and pipeline one column tile into the next (_kernels._gemm2_resident_run)
    KEEP_A2: int = 0

    # class constants, not fields: GEMM2's own value of a GEMM1 parameter (its name + "2"), and
    # the parameters only GEMM2 has
    GEMM2_FIELDS = ("BLOCK_N2", "num_warps2", "num_stages2", "GROUP_M2", "BLOCK_K2")
    GEMM2_ONLY = ("N_TILES2", "OVERLAP2", "KEEP_A2")
    KEEP_A2_STEPS = 6  # the K steps of GEMM2's inner dimension KEEP_A2 holds at most (_kernels._gemm2_resident_run)

    # the launch shape of the overlapped GEMM1 (its accumulator, the product in flight and the one
    # being added fill the register file: _gluon_kernels module docstring), on 64 rows or on 128
    # (gemm1_overlap_tall_kernel: two 64-column halves in turn)
    OVERLAP_TILE = {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8}
    OVERLAP_ROWS = (64, 128)
    # its pipeline by rows: at least 2 stages (one loading while one is read), at most what fits
    # in Hopper's 227 KiB of shared memory with the epilogue's layout change (every stage is
    # allocated: 40 KiB each on 64 rows; 32 KiB each on 128, with 16 KiB for the first half's
    # activation and up to 64 KiB for the epilogue: 5 stages asked for 240 KiB on an H200)
    OVERLAP_STAGES = {64: (2, 5), 128: (2, 4)}
    # the overlapped GEMM2's tile (BLOCK_M, GEMM2's BLOCK_N) on 8 warps, BLOCK_K 128: two
    # warpgroups on 64 rows each. 64 x 128 (warpgroups side by side) ran Mixtral-8x7B's layer
    # 10-13% slower than the Gluon GEMM1's table entries it would follow, and 64 x 256 spilled
    # (BENCHMARKS.md, fifteenth session).
    OVERLAP2_TILES = ((128, 128),)
    OVERLAP2_STAGES = (2, 6)  # 32 KiB a stage at 128 x 128

    def __post_init__(self):
        # one launch, one spelling: a GEMM2 parameter equal to GEMM1's is stored as unset, and so
        # is a run of one column tile
        for name in self.GEMM2_FIELDS:
            if getattr(self, name) == getattr(self, name[:-1]):
                object.__setattr__(self, name, 0)
        if self.N_TILES2 == 1:
            object.__setattr__(self, "N_TILES2", 0)

    def gemm1(self) -> "KernelConfig":
        """This config without GEMM2's own launch (both GEMMs launched as GEMM1)."""
        unset = dict.fromkeys(self.GEMM2_FIELDS + self.GEMM2_ONLY, 0)
        return dataclasses.replace(self, **unset) if self.has_gemm2 else self

    def gemm2(self) -> "KernelConfig":
        """The config GEMM2 runs: GEMM2's own parameters in place of GEMM1's, where set (JOIN and
        OVERLAP, GEMM1's alone, cleared), and N_TILES2, OVERLAP2 and KEEP_A2 kept."""
        if not self.has_gemm2:
            return self
        own = {name[:-1]: getattr(self, name) for name in self.GEMM2_FIELDS if getattr(self, name)}
        return dataclasses.replace(self.gemm1(), **own, JOIN=0, OVERLAP=0, N_TILES2=self.N_TILES2,
                                   OVERLAP2=self.OVERLAP2, KEEP_A2=self.KEEP_A2)

    def with_gemm2(self, **params: int) -> "KernelConfig":
        """This config with GEMM2's parameters set (BLOCK_N=, num_warps=, num_stages=, GROUP_M=,
        BLOCK_K=, N_TILES=, OVERLAP=, KEEP_A=)."""
        names = [f[:-1] for f in self.GEMM2_FIELDS + self.GEMM2_ONLY]
        for name in params:
            if name not in names:
                raise TypeError(f"GEMM2 has no parameter {name!r} of its own; it has {', '.join(names)}")
        return dataclasses.replace(self, **{name + "2": value for name, value in params.items()})

    @property
    def gemm2_tiles(self) -> int:
        """Column tiles per GEMM2 program (N_TILES2, at least 1)."""
        return max(self.N_TILES2, 1)

    @property
    def has_gemm2(self) -> bool:
        return any(getattr(self, name) for name in self.GEMM2_FIELDS + self.GEMM2_ONLY)

    @property
    def is_gemm2_variant(self) -> bool:
        """Whether GEMM2 has a launch of its own beyond its K step: a config of the tuner's GEMM2
        step (its variants of a base config). BLOCK_K2 alone (GEMM1 in wider K steps than GEMM2's)
        is a config of the search space itself, a base of that step like any other."""
        return any(getattr(self, name) for name in self.GEMM2_FIELDS + self.GEMM2_ONLY if name != "BLOCK_K2")

    def problems(self, scheme: QuantScheme, gemm: str = "both") -> list[str]:
        """Why this config cannot run `scheme` (empty when it can). `gemm`: which GEMM runs this
        tile, "both" for a config without GEMM2's own launch ("gemm1" and "gemm2" are the checks
        of a config with one)."""
        if gemm not in ("both", "gemm1", "gemm2"):
            raise ValueError(f"gemm={gemm!r}: expected 'both', 'gemm1' or 'gemm2'")
        if self.has_gemm2:
            if self.GEMV:
                return self._gemv_gemm2_problems(scheme)
            negative = [f"{name}={getattr(self, name)} must be 0 (GEMM1's) or positive" for name in self.GEMM2_FIELDS
                        if getattr(self, name) < 0]
            negative += [f"{name}={getattr(self, name)} must be 0 or positive" for name in self.GEMM2_ONLY
                         if getattr(self, name) < 0]
            if negative:
                return negative
            # GEMM2's tile (its runs checked above, its Gluon kernel and kept activations below)
            tile2 = dataclasses.replace(self.gemm2(), N_TILES2=0, OVERLAP2=0, KEEP_A2=0)
            own = tile2.problems(scheme, "gemm2") + (self._overlap2_problems(scheme) if self.OVERLAP2 else [])
            own += self._keep_a2_problems() if self.KEEP_A2 else []
            return self.gemm1().problems(scheme, "gemm1") + [f"GEMM2: {p}" for p in own]
        out = []
        if self.GEMV:  # K steps of whole 128-groups, columns without a tensor-core tile, no row tiles
            smallest = {"BLOCK_N": 4, "BLOCK_K": 128}
            path = " on the GEMV path (it reads K in whole groups of 128)"
        else:
            smallest = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}
            path = ""
        for name, least in smallest.items():
            v = getattr(self, name)
            if v < least or v & (v - 1):
                out.append(f"{name}={v} must be a power of two >= {least}{path if name == 'BLOCK_K' else ''}")
        if scheme.is_fp8 and not self.GEMV and self.BLOCK_K < 32:
            # Triton's NVIDIA backend compiles 8-bit tensor-core dots with K >= 32 only
            out.append(f"BLOCK_K={self.BLOCK_K} must be at least 32 for FP8 tensor-core dots")
        if self.BLOCK_K != 128 and not self.GEMV:
            out += self._k_step_problems(scheme, gemm)
        if scheme.weight == "block" and (self.BLOCK_N > 128 or 128 % self.BLOCK_N):
            out.append(f"BLOCK_N={self.BLOCK_N} must divide 128 for 128x128 weight blocks")
        if self.num_warps not in (1, 2, 4, 8, 16):
            out.append(f"num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")
        if not self.GEMV and self.GROUP_M < 1:  # the tile order divides by it (_kernels._tile_ids)
            out.append(f"GROUP_M={self.GROUP_M} must be a positive integer")
        if not 1 <= self.num_stages <= 8:
            out.append(f"num_stages={self.num_stages} must be between 1 and 8")
        if self.JOIN not in (0, 1):
            out.append(f"JOIN={self.JOIN} must be 0 or 1")
        if self.OVERLAP not in (0, 1):
            out.append(f"OVERLAP={self.OVERLAP} must be 0 or 1")
        elif self.OVERLAP:
            out += self._overlap_problems(scheme)
        if self.GEMV not in (0, 1, 2):
            out.append(f"GEMV={self.GEMV} must be 0 (tiled), 1 or 2 (the GEMV path, GEMM1 reducing each K step or once)")
        elif self.GEMV and self.JOIN:
            out.append(f"JOIN=1 is a tile of the tensor-core path; the GEMV path (GEMV={self.GEMV}) has none")
        elif self.JOIN and scheme.is_fp8 and (scheme.activation == "group" or scheme.weight == "block"):
            # the joined tile sums the whole K in one accumulator: no room for per-K-step scales
            out.append(f"JOIN=1 cannot apply {scheme.name}'s per-128-of-K scales (use JOIN=0)")
        return out

    def _k_step_problems(self, scheme: QuantScheme, gemm: str) -> list[str]:
        """Why this tile's K step (not 128) cannot run `scheme` in `gemm`: each step of a tile
        applies at most one 1x128 group's scale. GEMM1 reads 1x128-group activations
        (`fp8-block128`) and 128x128 weight blocks; GEMM2 reads the intermediate that GEMM1 of
        an FP8 scheme with per-token or group activations quantizes per 1x128 group. GEMM1 of a
        per-token scheme applies its scales after the K loop, so any step suits it (BLOCK_K2=128
        gives GEMM2 its own)."""
        if not scheme.is_fp8:
            return []
        if scheme.activation == "group" or scheme.weight == "block":
            return [f"BLOCK_K={self.BLOCK_K} must be 128 for {scheme.name} (its scales change every 128 of K)"]
        if scheme.activation == "token" and gemm != "gemm1":
            out = f"BLOCK_K={self.BLOCK_K} must be 128 for {scheme.name}'s GEMM2 (it reads an intermediate quantized per 1x128 group)"
            return [out + ("; GEMM1 alone may take wider steps, with BLOCK_K2=128 for GEMM2" if gemm == "both" else "")]
        return []

    # GEMM2's own launch parameters the GEMV path takes (gemv.gemv2: its column block, warps and
    # K-loop pipeline depth; its K step follows BLOCK_K, gemv.gemm2_groups)
    GEMV_GEMM2_FIELDS = ("BLOCK_N2", "num_warps2", "num_stages2")

    def _gemv_gemm2_problems(self, scheme: QuantScheme) -> list[str]:
        """Why this GEMV config with GEMM2's own launch cannot run `scheme`."""
        others = [name for name in self.GEMM2_FIELDS + self.GEMM2_ONLY
                  if getattr(self, name) and name not in self.GEMV_GEMM2_FIELDS]
        if others:
            return [f"{' / '.join(others)} {'are' if len(others) > 1 else 'is'} for the tiled path; the GEMV path (GEMV={self.GEMV}) takes only "
                    f"{', '.join(self.GEMV_GEMM2_FIELDS[:-1])} and {self.GEMV_GEMM2_FIELDS[-1]} of GEMM2's own"]
        negative = [f"{name}={getattr(self, name)} must be 0 (GEMM1's) or positive" for name in self.GEMV_GEMM2_FIELDS
                    if getattr(self, name) < 0]
        if negative:
            return negative
        return self.gemm1().problems(scheme) + [f"GEMM2: {p}" for p in self.gemm2().problems(scheme)]

    def _overlap_problems(self, scheme: QuantScheme) -> list[str]:
        """Why OVERLAP=1 cannot run `scheme` with this tile: the overlapped kernel is GEMM1 for FP8
        weights and dynamic per-token or 1x128-group activations, whose intermediate it quantizes
        per 1x128 group, on OVERLAP_TILE with OVERLAP_ROWS."""
        out = _gluon_scheme_problems("OVERLAP", scheme)
        wrong = [f"{name}={getattr(self, name)}" for name, v in self.OVERLAP_TILE.items() if getattr(self, name) != v]
        if self.BLOCK_M not in self.OVERLAP_ROWS:
            wrong.insert(0, f"BLOCK_M={self.BLOCK_M}")
        if wrong:
            want = " or ".join(map(str, self.OVERLAP_ROWS)) + ", " + ", ".join(
                f"{name}={v}" for name, v in self.OVERLAP_TILE.items())
            out.append(f"OVERLAP=1 runs BLOCK_M={want}; got {', '.join(wrong)}")
        low, high = self.OVERLAP_STAGES.get(self.BLOCK_M, (1, 8))  # other rows: refused above
        if not low <= self.num_stages <= high:
            out.append(f"OVERLAP=1 runs {low} to {high} pipeline stages on {self.BLOCK_M} rows (all are allocated in "
                       f"shared memory); got num_stages={self.num_stages}")
        if self.JOIN or self.GEMV:
            out.append("OVERLAP=1 is a tiled GEMM1 of its own: JOIN and GEMV must be 0")
        return out

    def _overlap2_problems(self, scheme: QuantScheme) -> list[str]:
        """Why OVERLAP2=1 cannot run `scheme` with GEMM2's launch: the overlapped GEMM2 reads an
        FP8 intermediate with 1x128 group scales (what GEMM1 writes for per-token and 1x128-group
        activations, per-channel or block weights), on OVERLAP2_TILES, one column tile per program."""
        if self.OVERLAP2 != 1:
            return [f"OVERLAP2={self.OVERLAP2} must be 0 or 1"]
        g2 = self.gemm2()
        out = _gluon_scheme_problems("OVERLAP2", scheme)
        tiles = " or ".join(f"{m}x{n}" for m, n in self.OVERLAP2_TILES)
        if (g2.BLOCK_M, g2.BLOCK_N) not in self.OVERLAP2_TILES or g2.BLOCK_K != 128 or g2.num_warps != 8:
            out.append(f"OVERLAP2=1 runs BLOCK_M x GEMM2's BLOCK_N {tiles} with BLOCK_K 128 on 8 warps; got "
                       f"{g2.BLOCK_M}x{g2.BLOCK_N}, BLOCK_K {g2.BLOCK_K}, {g2.num_warps} warps")
        low, high = self.OVERLAP2_STAGES
        if not low <= g2.num_stages <= high:
            out.append(f"OVERLAP2=1 runs {low} to {high} pipeline stages; got GEMM2's num_stages={g2.num_stages}")
        if g2.N_TILES2 > 1:
            out.append(f"OVERLAP2=1 runs one column tile per program; got N_TILES2={g2.N_TILES2}")
        return out

    def _keep_a2_problems(self) -> list[str]:
        """Why KEEP_A2=1 cannot run with GEMM2's launch (the inner dimension's bound,
        KEEP_A2_STEPS, depends on the shape: launch._check_config checks it before any launch)."""
        if self.KEEP_A2 != 1:
            return [f"KEEP_A2={self.KEEP_A2} must be 0 or 1"]
        out = []
        if self.gemm2_tiles < 2:
            out.append("KEEP_A2=1 keeps a row block's activations across a run of column tiles: it needs N_TILES2 > 1")
        if self.OVERLAP2:
            out.append("KEEP_A2=1 is a form of the Triton GEMM2; the Gluon one (OVERLAP2=1) has no runs")
        return out

    def keep_a2_fits(self, n: int) -> bool:
        """Whether GEMM2's inner dimension n fits the K steps KEEP_A2 holds (KEEP_A2_STEPS)."""
        return n <= self.KEEP_A2_STEPS * self.gemm2().BLOCK_K

    def keep_a2_problem(self, n: int) -> str | None:
        """Why KEEP_A2 cannot run a problem whose intermediate has n columns (None: it can, or
        KEEP_A2 is off): the launch's refusal and a table entry's, in one wording."""
        if not self.KEEP_A2 or self.keep_a2_fits(n):
            return None
        return (f"KEEP_A2=1 holds GEMM2's inner dimension in at most {self.KEEP_A2_STEPS} K steps of "
                f"{self.gemm2().BLOCK_K}; this problem's intermediate has {n} columns")

    def to_dict(self) -> dict:
        """The fields, without GEMM2's own and OVERLAP where unset (tables of configs that have
        none stay as they were)."""
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if v or k not in self.GEMM2_FIELDS + self.GEMM2_ONLY + ("OVERLAP",)}

    @classmethod
    def from_dict(cls, d: dict) -> "KernelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: int(v) for k, v in d.items() if k in names})

    # what a table entry must give, and what `moekit tune` writes beside a config (for people)
    TABLE_REQUIRED = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
    TABLE_NOTES = ("us", "default_us")

    @classmethod
    def from_table_entry(cls, entry) -> "KernelConfig":
        """A tuned table's entry, strictly (a file may be edited by hand, or be vLLM's): the six
        launch fields present, every field a non-negative integer (not a float or a bool; the six
        positive), no other key than the fields and tune's notes. ValueError naming the first
        problem: an entry filled in with the class defaults would run a config nobody chose."""
        if not isinstance(entry, dict):
            raise ValueError(f"expected an object of launch parameters, got {type(entry).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(k for k in entry if k not in names and k not in cls.TABLE_NOTES)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown}: a moekit config has {names} (vLLM's BLOCK_SIZE_M ... are "
                             "not read; `moekit tune --export-vllm` writes vLLM's files, not the other way round)")
        missing = [k for k in cls.TABLE_REQUIRED if k not in entry]
        if missing:
            raise ValueError(f"missing {missing}")
        for k in names:
            v, least = entry.get(k, 0), 1 if k in cls.TABLE_REQUIRED else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{k} is {v!r}, expected an integer >= {least}")
        return cls(**{k: entry[k] for k in names if k in entry})


def _gluon_scheme_problems(flag: str, scheme: QuantScheme) -> list[str]:
    """Why `flag`=1 (OVERLAP or OVERLAP2) cannot run `scheme`, as far as the scheme goes."""
    if gluon_scheme(scheme):
        return []
    return [f"{flag}=1 runs FP8 schemes with per-channel or block weights and dynamic per-token or "
            f"1x128-group activations, not {scheme.name}"]


def gluon_scheme(scheme: QuantScheme) -> bool:
    """Whether the Gluon kernels (OVERLAP, OVERLAP2) take this scheme: FP8 weights per channel or
    in 128x128 blocks, activations quantized dynamically per token or per 1x128 group, so that
    GEMM1 writes the intermediate in 1x128 groups (in precise mode; the launch steps check the mode)."""
    return (scheme.is_fp8 and scheme.activation in ("token", "group") and not scheme.static_activation
            and scheme.weight in ("channel", "block"))


def default_config(shape: MoEShape, scheme: QuantScheme, num_tokens: int) -> KernelConfig:
    """Analytic defaults by regime, from the rows each expert receives on average.

    Decode (<= 16 rows per expert) is memory-bound: 16-row tiles and narrow 64-column tiles put
    every SM to streaming weights. Beyond that, 128-column tiles let GEMM1's epilogue quantize
    whole 1x128 groups, so GEMM2 reads FP8 straight into the tensor cores: on an H200 (2026-12-02,
    BENCHMARKS.md) this was 2.5x faster at M = 4096 than 64-column tiles, with BLOCK_M 64 best on
    128/256-expert shapes and BLOCK_M 128 on Mixtral's 8 experts (1024 rows per expert).
    """
    rows_per_expert = num_tokens * shape.top_k / shape.num_experts
    if rows_per_expert <= 16:
        return KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128 if scheme.is_fp8 else 64, GROUP_M=1, num_warps=4, num_stages=4)
    block_m = 128 if rows_per_expert >= 512 else 64
    return KernelConfig(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128 if scheme.is_fp8 else 64, GROUP_M=8, num_warps=8, num_stages=4)


@dataclasses.dataclass(frozen=True)
class TunedTable:
    configs: dict[int, KernelConfig]  # by batch size
    top_k: int | None  # the top-k it was measured with (meta.top_k), None where the meta has none


def load_table(path: Path, scheme: QuantScheme | None = None, shape: MoEShape | None = None) -> TunedTable | None:
    """A tuned triton table, read once per version of the file (and again after
    moekit.tables.clear_cache()); None, with a warning, for a file that is not one or cannot be
    read (a broken symlink, a file or folder the process may not read: never an error). Given
    the problem the table is for (`scheme`, and `shape` for its intermediate size), an entry whose
    config cannot run it is skipped with a warning too (entry_problems), so that it takes no part
    in the nearest-size lookup or the layering of tables (_layered_table)."""
    try:
        st = path.stat()
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
    except OSError:
        stamp = None  # _load_table's read fails alike, and its warning names the file and the error
    return _load_table(path, stamp, tables.generation(), scheme, shape)


def entry_problems(cfg: KernelConfig, scheme: QuantScheme, shape: MoEShape | None = None) -> list[str]:
    """Why a table's config cannot run its problem (empty when it can): KernelConfig.problems,
    and with `shape` the intermediate size KEEP_A2 must hold (what launch._check_config refuses)."""
    out = cfg.problems(scheme)
    too_wide = cfg.keep_a2_problem(shape.n) if not out and shape is not None else None
    return out + [too_wide] if too_wide else out


@functools.lru_cache(maxsize=256)
def _load_table(path: Path, stamp, generation: int = 0, scheme: QuantScheme | None = None,
                shape: MoEShape | None = None) -> TunedTable | None:
    """load_table's cached work: `stamp` and `generation` only key the cache (a rewritten file,
    also within one tick of a coarse clock, has another size or inode, or a clear_cache between)."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("configs"), dict):
            raise ValueError("not a moekit triton table: no 'configs' object (vLLM's own config files are not "
                             "read here)")
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise ValueError(f"'meta' is a {type(meta).__name__}, expected an object")
        mismatch = accumulation_mismatch(path.name, meta)
        if mismatch:
            raise ValueError(mismatch)
        top_k = meta.get("top_k")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"meta.top_k is {top_k!r}, expected a positive integer")
        configs = {}
        for key, entry in data["configs"].items():
            if not (key.isascii() and key.isdigit() and str(int(key)) == key and int(key) > 0):
                log.warning("moekit: tuned table %s: ignoring the entry of batch size %r (not a positive "
                            "integer)", path, key)
                continue
            try:
                cfg = KernelConfig.from_table_entry(entry)
            except ValueError as e:
                log.warning("moekit: tuned table %s: ignoring the entry of batch size %s: %s", path, key, e)
                continue
            problems = entry_problems(cfg, scheme, shape) if scheme is not None else []
            if problems:
                log.warning("moekit: tuned table %s: ignoring the entry of batch size %s: it cannot run %s: %s",
                            path, key, scheme.name, "; ".join(problems))
                continue
            configs[int(key)] = cfg
        return TunedTable(configs, top_k)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("moekit: ignoring tuned table %s: %s", path, e)
        return None


def _layered_table(shape: MoEShape, scheme: QuantScheme, device_name: str, accumulation: str,
                   skip_roots: Sequence[Path] = (), keep=lambda path: True) -> tuple[dict[int, KernelConfig], list[Path]] | None:
    """(configs by batch size, the files they came from, first found first), or None: every usable
    table in the order find_tables gives them (the user's folders, the shipped ones, a GPU of the
    sharing group last), layered: the first answers at every size within the range of sizes it
    measured, each later one only beyond the ranges of the tables before it. A tune of a few sizes
    (`moekit tune --batch-sizes 1 2 4 8` into MOEKIT_CONFIG_DIR, or a GPU's own table of decode
    sizes) so leaves the sizes it did not measure to the tables it would otherwise hide."""
    configs: dict[int, KernelConfig] = {}
    layers = tables.Layers()
    used: list[Path] = []
    for path in find_tables("triton", shape, scheme, device_name, accumulation, skip_roots):
        if not keep(path):
            continue
        table = load_table(path, scheme, shape)
        if table is not None and table.top_k not in (None, shape.top_k):
            # its name has E, N, H and the scheme, not top-k: measured on other rows per expert
            log.warning("moekit: tuned table %s was measured with top_k=%d, this layer has top_k=%d: not used",
                        path, table.top_k, shape.top_k)
            continue
        if table is None or not table.configs:
            continue
        mine = layers.take(table.configs)
        if mine:
            configs.update({m: table.configs[m] for m in mine})
            used.append(path)
    return (configs, used) if configs else None


def tuned_configs(shape: MoEShape, scheme: QuantScheme, device_name: str,
                  skip_own: Sequence[Path] = ()) -> tuple[dict[int, KernelConfig], Path] | None:
    """(configs by batch size, the first file they came from), or None: the tables found, layered
    (_layered_table). In fast accumulation mode the fast-mode tables refine the precise ones
    (moekit.tables): their sizes over the precise ones', unless the first fast table was measured
    on another GPU model and the first precise one on this one (this GPU's own measurements win
    over a borrowed table's). The tables of the current accumulation mode under the table roots
    `skip_own` are not read (a tune run's own: moekit.tune.runner.Worker._incumbents)."""
    mode = table_accumulation(scheme)
    found = precise = _layered_table(shape, scheme, device_name, "precise", skip_own if mode == "precise" else ())
    used = list(precise[1]) if precise else []
    if mode == "fast":
        first = precise[1][0] if precise else None  # this GPU's own wherever it has one (find_tables' order)
        fast = _layered_table(shape, scheme, device_name, "fast", skip_own,
                              keep=lambda path: tables.fast_may_refine(first, path, device_name))
        if fast is not None:
            found = ({**precise[0], **fast[0]} if precise else fast[0]), fast[1]
            used += fast[1]
    tables.note_borrowed(used, device_name, "tuned triton table")
    return (found[0], found[1][0]) if found else None


def nearest(table: dict[int, KernelConfig], num_tokens: int) -> KernelConfig:
    """The config measured at the batch size nearest to num_tokens in log space (tuned sizes are
    powers of two, and the regime changes with the ratio, not the difference); ties: the smaller
    size, decided in integers (log m - log lo <= log hi - log m  <=>  m*m <= lo*hi), as float
    logs round a geometric midpoint either way. (The backend decision tables interpolate between
    the two measured sizes around M instead: moekit.decisions.)"""
    m = max(num_tokens, 1)
    sizes = sorted(table)
    i = bisect.bisect_left(sizes, m)
    if i < len(sizes) and sizes[i] == m or i == 0:
        return table[sizes[i]]
    if i == len(sizes):
        return table[sizes[-1]]
    lo, hi = sizes[i - 1], sizes[i]
    return table[lo if m * m <= lo * hi else hi]


def gemv_may_win(shape: MoEShape, num_tokens: int) -> bool:
    """Whether the GEMV path (KernelConfig.GEMV) can beat the tiled one at this batch size: it
    reads an expert's weights once per (token, expert) pair, the tiled path once per expert, so
    only where pairs rarely share an expert: one token, or at most E / 2 pairs. On an H200
    (BENCHMARKS.md, seventh session) its tuned configs won inside this bound (GLM-4.5V M = 1-2,
    DeepSeek-V3 M = 1-4, Mixtral M = 1-2) and lost at GLM M = 4-8 and DeepSeek M = 8, still
    inside it."""
    return num_tokens <= 1 or num_tokens * shape.top_k <= shape.num_experts // 2


def get_config(shape: MoEShape, scheme: QuantScheme, num_tokens: int, device_name: str | None) -> KernelConfig:
    """The tuned config of the nearest batch size, else the analytic default. A GEMV-path entry
    is not carried beyond `gemv_may_win`'s bound (a table tuned only at decode sizes would
    otherwise send prefill through it): the nearest tiled entry, else the default, runs there.

    Runs on every layer call. Listing the table folders cost 130 µs of host time per call, 235 µs
    in fast mode (two modes' tables), on the dev machine's CPU, so the table of a problem is
    looked up once (moekit.tables.memoized: tables written later are seen after
    moekit.select.clear_cache()) and each batch size's answer is remembered beside it."""
    key = ("triton-configs", shape, scheme, device_name, table_accumulation(scheme))
    return tables.memoized(key, lambda: problem_configs(shape, scheme, device_name)).get(num_tokens)


def problem_configs(shape: MoEShape, scheme: QuantScheme, device_name: str | None,
                    skip_own: Sequence[Path] = ()) -> "ProblemConfigs":
    """The configs the backend runs for one problem, per batch size (not remembered: get_config
    is the remembered lookup), from the tables found (tuned_configs: `skip_own`)."""
    found = tuned_configs(shape, scheme, device_name, skip_own) if device_name else None
    return ProblemConfigs(shape, scheme, found[0] if found else {})


class ProblemConfigs:
    """One problem's tuned configs (all, and the tiled ones), and the answer per batch size."""

    SIZE_LIMIT = 16384  # remembered batch sizes; beyond it the memo starts again (as select's)

    def __init__(self, shape: MoEShape, scheme: QuantScheme, table: dict[int, KernelConfig]):
        self.shape, self.scheme = shape, scheme
        self.table = table
        self.tiled = {m: c for m, c in self.table.items() if not c.GEMV}
        self.by_size: dict[int, KernelConfig] = {}

    def get(self, num_tokens: int) -> KernelConfig:
        cfg = self.by_size.get(num_tokens)
        if cfg is None:
            if len(self.by_size) >= self.SIZE_LIMIT:
                self.by_size.clear()
            cfg = self.by_size[num_tokens] = self._choose(num_tokens)
        return cfg

    def _choose(self, num_tokens: int) -> KernelConfig:
        # every entry runs this problem: load_table skipped the others, with a warning, before
        # the nearest size and the layering were worked out
        table = self.table if gemv_may_win(self.shape, num_tokens) else self.tiled
        return nearest(table, num_tokens) if table else default_config(self.shape, self.scheme, num_tokens)
