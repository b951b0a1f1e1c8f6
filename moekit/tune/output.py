"""What `moekit tune` writes, rebuilt from the journals (moekit.tune.journal) each time:

OUT/triton/<table name>     the triton backend's table: per batch size the config chosen there
                            (chosen_config) and its µs (read by moekit.backends.triton.config)
OUT/backends/<table name>   the backend decision table: per batch size every backend's µs and the
                            winner (read by moekit.decisions; format below)
DIR/<vLLM name>             with --export-vllm: the same configs in vLLM's fused_moe file format
                            (DIR/fast/<vLLM name> for a fast-mode table: vLLM's names have no mode)

Nothing already written is lost: a file about to be replaced is first copied to
<name>.bak-<date>-<time> (never over an earlier copy) unless it is exactly what tune last wrote
there, for the same problem, and the new one keeps all its batch sizes (`_write_keeping`). So a
table edited by hand, one from elsewhere, vLLM's own file in its config folder, the vLLM file of
another scheme tuned into the same folders (fp8-channel-token and fp8-tensor-dynamic both name
vLLM's `dtype=fp8_w8a8` file), or a table whose journals were measured under other conditions
(left out of the rebuild: moekit.tune.journal) is kept, while the rewrites of a run and its
resumes add no copies. OUT/.progress/written.json records what tune last wrote to each file, and
for which problem (WrittenRecord).

Decision table, version 1 (moekit.decisions reads exactly this):
    {"format": "moekit-backend-table", "version": 1,
     "meta": {"device_name", "num_experts", "hidden", "intermediate" (per GPU), "top_k", "scheme",
              "dtype", "routing" (a recorded routing: its file, and "routing_sha256"), "mode": "layer",
              "moekit", "torch", "triton", "date"},
     "batch_sizes": {"<M>": {"us": {"<backend>": µs}, "winner": "<backend>",
                             "errors": {"<backend>": "<one-line reason>"}}}}
Each size's µs come from its decision timing when there is a current one (every backend and
triton's fastest configs in the same interleaved rounds, the replays cycling through
meta.routings routings: moekit.tune.runner; triton's µs are those of the fastest config there,
the one the triton table takes: chosen_config); otherwise from the separate timings (those of
the triton table's config, chosen_config, and each backend's own).

A size gets an entry only once triton and every backend the last run at that size was asked to
time (journal "backends_asked") have a time or an error there: a winner among the backends a
budget cut left timed would be trusted by auto as a comparison that never ran (`undecided`). Such
a size is left out: auto answers there from the decided sizes around it (decisions.BackendTable.locate);
beyond the decided sizes, and where none is decided (no table written), from another table found
for the problem, else the nearest decided size or its heuristic (`_undecided_note`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

from ..backends.triton.config import KernelConfig, gemv_may_win
from ..spec import MoEShape, QuantScheme, get_scheme
from ..tables import write_json_atomically

BACKEND_TABLE_FORMAT = "moekit-backend-table"
BACKEND_TABLE_VERSION = 1
TRITON_TABLE_FORMAT = "moekit-triton-configs"

# vLLM's own tuner (benchmarks/kernels/benchmark_moe.py) searches BLOCK_SIZE_N up to 256 and, for
# 128x128 block-quantized weights, only multiples of 128 for BLOCK_SIZE_N and BLOCK_SIZE_K.
VLLM_MAX_BLOCK_SIZE_N = 256
# and num_warps 4 and 8 (CUDA), and GROUP_SIZE_M 1, 16, 32, 64. moekit searches GROUP_M 1/8/16 (32):
# a measured GROUP_M of 8 is exported as is, with a note (vLLM's kernel takes any GROUP_SIZE_M, which
# only orders the tiles; another value would be a config nobody timed).
VLLM_NUM_WARPS = (4, 8)
VLLM_GROUP_SIZE_M = (1, 16, 32, 64)
WRITTEN_RECORD = "written.json"  # under OUT/.progress: what tune last wrote to each file (WrittenRecord)


# ------------------------------------------------------------------------- reading journals


# The journal fields of the GEMM2 step's bases (runner.gemm2_bases), one per kind of base.
GEMM2_FIELDS = ("gemm2", "gemm2_wide", "gemm2_tall", "gemm2_narrow")


def runs_here(journal: dict, entry: dict) -> bool:
    """Whether the triton backend would run the config of this journal entry at the journal's
    size: a GEMV-path config only within config.gemv_may_win (beyond it the backend's lookup takes
    a tiled entry). The tuner no longer times one beyond it, but journals of earlier runs hold such
    timings (sizes between, the full search): they must not become a table's config."""
    if not (entry.get("config") or {}).get("GEMV"):
        return True
    problem, M = journal.get("problem"), journal.get("batch_size")
    if not problem or M is None:
        return True
    return gemv_may_win(MoEShape(problem["num_experts"], problem["hidden"], problem["intermediate"], problem["top_k"]), M)


def runnable_timings(journal: dict) -> dict[str, dict]:
    """The journal's triton configs that ran (a time, not a failure) and would run here (runs_here)."""
    return {k: v for k, v in journal["configs"].items() if "us" in v and runs_here(journal, v)}


def best_config(journal: dict) -> tuple[str, dict] | None:
    """(key, entry) of the fastest triton config measured in a journal; ties: the smaller key."""
    ran = [(v["us"], k) for k, v in runnable_timings(journal).items()]
    if not ran:
        return None
    _, key = min(ran)
    return key, journal["configs"][key]


# How many of a size's fastest triton configs (by their separate timings) the decision timing
# times again, over several routings in interleaved rounds (runner._decide), the incumbent too:
# the table takes the fastest there. The separate timings are of one routing, one config at a
# time, and ranked configs wrongly: on an H100 (BENCHMARKS.md, twenty-fifth session) a search's
# fastest config measured 127 µs at GLM-4.5V M = 8 where every other was 185, and 193 in the
# decision timing and in `moekit bench`; the tables chosen that way were up to 12% slower in
# `moekit bench` than the H200's tables they replaced (Mixtral M = 4096). Counted per flush method
# of the journal's timings (decision_candidates).
CONFIRMED_CONFIGS = 3


def incumbent_key(journal: dict) -> str | None:
    """The key of the config a table gave at this size before the run (journal "incumbent")."""
    return (journal.get("incumbent") or {}).get("key")


def decision_candidates(journal: dict) -> list[str]:
    """The keys of the triton configs a size's decision timing confirms: the CONFIRMED_CONFIGS
    fastest separately timed (ties: the smaller key) of each flush method in the journal, and the
    incumbent where it ran and is not among them.

    Per method, because the older harness could read a config up to 60 µs too fast: ranked
    together, such misread configs could push every config timed by the current harness (those
    new to the search space, say) out of the decision timing, which would then never see them.
    Entries without "flush" (timing.FLUSH_METHOD, recorded since the twenty-seventh session) form
    one class: the older harness's timings, and those of the per-sample harness's first session
    (the twenty-sixth, whose journals did not record it; the shipped H100 journals' separate
    timings are all of the older harness, from the twenty-fifth)."""
    timed = runnable_timings(journal)
    by_method: dict[str, list[tuple[float, str]]] = {}
    for key, entry in timed.items():
        by_method.setdefault(entry.get("flush", "unrecorded"), []).append((entry["us"], key))
    ranked = sorted((us, key) for timings in by_method.values() for us, key in sorted(timings)[:CONFIRMED_CONFIGS])
    keys = [key for _, key in ranked]
    incumbent = incumbent_key(journal)
    if incumbent not in keys and incumbent in timed:
        keys.append(incumbent)
    return keys


def decision_is_current(journal: dict) -> bool:
    """Whether the decision timing in the journal timed the configs it would time now."""
    decision = journal.get("decision") or {}
    return bool(decision) and decision.get("candidates") == decision_candidates(journal)


def chosen_config(journal: dict) -> tuple[str, dict] | None:
    """(key, entry) of the config the triton table takes at this size: the fastest of the
    decision timing's configs (that timing's last run, current or not); else the incumbent where
    it ran (a config replaces the one used before only once confirmed: a budget cut before the
    decision timing, or a journal of an older moekit, keeps it); else the fastest separately
    timed (best_config). None where no config ran."""
    timed = runnable_timings(journal)  # what ran here and would run here
    if not timed:
        return None
    decision = journal.get("decision") or {}
    # an older decision timing (a later search added candidates, and the budget ended before it
    # was redone) still confirmed its own winner against the incumbent: kept until redone
    confirmed = {k: us for k, us in (decision.get("triton_us") or {}).items() if k in timed}
    if confirmed:
        key = min(confirmed, key=lambda k: (confirmed[k], k))
        return key, timed[key]
    incumbent = incumbent_key(journal)
    if incumbent in timed:
        return incumbent, timed[incumbent]
    return best_config(journal)


def search_complete(journal: dict) -> bool:
    return bool(journal.get("search") and journal["search"].get("complete"))


def is_between(journal: dict) -> bool:
    """A journal of a size between the tuned ones (only the neighbours' configs timed, no search)."""
    return "between_configs" in journal or "between_config" in journal


def neighbour_configs(tuned: dict[int, KernelConfig], M: int) -> list[KernelConfig]:
    """The best configs of the tuned sizes just below and above M (one when they agree or M lies
    beyond the tuned sizes)."""
    below = [s for s in tuned if s < M]
    above = [s for s in tuned if s > M]
    picks = [tuned[max(below)]] if below else []
    if above and tuned[min(above)] not in picks:
        picks.append(tuned[min(above)])
    return picks


def _common_meta(journals: list[dict]) -> dict:
    fp, problem = journals[-1]["fingerprint"], journals[-1]["problem"]
    return {
        "device_name": fp["device_name"],
        "num_experts": problem["num_experts"],
        "hidden": problem["hidden"],
        "intermediate": problem["intermediate"],
        "top_k": problem["top_k"],
        "scheme": problem["scheme"],
        "dtype": fp["dtype"],
        "routing": fp.get("routing_file", fp["routing"]),  # a recorded routing: its file (runner.routing_fields)
        **({"routing_sha256": fp["routing_sha256"]} if "routing_sha256" in fp else {}),
        "mode": "layer",
        "moekit": fp["moekit"],
        "torch": fp["torch"],
        "triton": fp["triton"],
        "date": max(j["updated"] for j in journals),  # when the last measurement was made
        **({key: fp[key] for key in ("fp8_accumulation", "pdl") if key in fp}),
    }


# ---------------------------------------------------------------------------- the tables


def triton_table(journals: list[dict], run_meta: dict | None = None) -> dict | None:
    """{"meta": {...}, "configs": {"<M>": {BLOCK_M.., "us": .., "default_us": ..}}}, or None when
    no config ran at any batch size."""
    configs: dict[str, dict] = {}
    incomplete = []
    for j in journals:
        best = chosen_config(j)
        if best is None:
            continue
        _, entry = best
        default = j["configs"].get(j.get("default") or "", {})
        configs[str(j["batch_size"])] = {
            **KernelConfig.from_dict(entry["config"]).to_dict(),
            "us": entry["us"],
            "default_us": default.get("us"),
        }
        if not search_complete(j) and not is_between(j):
            incomplete.append(j["batch_size"])
    if not configs:
        return None
    meta = {"format": TRITON_TABLE_FORMAT, **_common_meta(journals), **(run_meta or {})}
    # the searches the configs came from, as the journals recorded them (a run with
    # --search-space none only reuses what earlier runs found)
    spaces = sorted({j["search"]["space"] for j in journals if j.get("search")})
    if spaces:
        meta["search_space"] = "+".join(spaces)
    if "pruned" not in spaces:
        meta.pop("neighbour_margin", None)
    meta["incomplete_batch_sizes"] = incomplete  # best so far: the search stopped early there
    return {"meta": meta, "configs": configs}


def undecided(journal: dict, us: dict, errors: dict) -> list[str]:
    """The backends asked for at the journal's size (triton, and journal "backends_asked") that
    have neither a time nor an error there. Journals of a moekit before the field: [] (as before)."""
    asked = journal.get("backends_asked")
    if asked is None:
        return []
    return [name for name in ["triton", *asked] if name not in us and name not in errors]


def backend_table(journals: list[dict], left_out: dict[int, list[str]] | None = None) -> dict | None:
    """The decision table (see the module docstring), or None when no size is decided. `left_out`,
    when given, receives {batch size: the backends not timed} of the sizes left undecided."""
    sizes: dict[str, dict] = {}
    routings: set[int] = set()
    for j in journals:
        us: dict[str, float] = {}
        errors: dict[str, str] = {}
        best = chosen_config(j)
        decision = j.get("decision") or {}
        if best is not None and decision_is_current(j) and decision.get("us"):
            # every backend timed in the same rounds over several routings (runner._decide)
            us, errors = dict(decision["us"]), dict(decision.get("errors", {}))
            routings.add(decision["routings"])
        elif best is not None:
            us["triton"] = best[1]["us"]
        elif j["configs"]:
            default = j["configs"].get(j.get("default") or "")
            errors["triton"] = (default or next(iter(j["configs"].values()))).get("error", "no config ran")
        for name, result in sorted(j["backends"].items()):
            if "error" in result:  # a failure or a wrong output of the separate timing always stands
                us.pop(name, None)
                errors[name] = result["error"]
            elif name not in us and name not in errors:  # not in the decision timing
                us[name] = result["us"]
        missing = undecided(j, us, errors)
        if missing and left_out is not None:
            left_out[j["batch_size"]] = missing
        if not us or missing:
            continue
        entry: dict = {"us": us, "winner": min(us, key=lambda b: (us[b], b))}
        if errors:
            entry["errors"] = errors
        sizes[str(j["batch_size"])] = entry
    if not sizes:
        return None
    meta = _common_meta(journals)
    if routings:  # how many routings the decision timings cycled through (a list if they differ)
        meta["routings"] = routings.pop() if len(routings) == 1 else sorted(routings)
    return {
        "format": BACKEND_TABLE_FORMAT,
        "version": BACKEND_TABLE_VERSION,
        "meta": meta,
        "batch_sizes": sizes,
    }


# ------------------------------------------------------------------------------- vLLM


def vllm_device_name(device_name: str) -> str:
    """As vLLM's get_config_file_name writes it: spaces to '_', every H200 variant 'NVIDIA_H200'."""
    name = device_name.strip().replace(" ", "_")
    return "NVIDIA_H200" if "H200" in name.split("_") else name


def vllm_file_name(num_experts: int, n: int, device_name: str, scheme: QuantScheme) -> str:
    """E={E},N={N},device_name={dev}[,dtype=fp8_w8a8][,block_shape=[128,128]].json; N is the
    intermediate size per GPU (vLLM's w2.shape[2]); unquantized schemes have no dtype part."""
    dtype = ",dtype=fp8_w8a8" if scheme.is_fp8 else ""
    block = f",block_shape=[{scheme.block},{scheme.block}]" if scheme.block else ""
    return f"E={num_experts},N={n},device_name={vllm_device_name(device_name)}{dtype}{block}.json"


def vllm_config(cfg: KernelConfig, scheme: QuantScheme) -> tuple[dict | None, str | None]:
    """(vLLM's config for the same tile, None) or (None, why vLLM cannot take it).

    vLLM runs one config for both GEMMs, each tile one BLOCK_SIZE_N-wide slice of w13's 2N rows
    (gate or up). A moekit tile computes BLOCK_N gate and BLOCK_N up columns: 2 * BLOCK_N rows of
    w13, the same operand tiles, shared memory and accumulators as vLLM's BLOCK_SIZE_N = 2 * BLOCK_N.
    GEMM1 holds two thirds of the layer's work, so its tile is the one exported (vLLM's GEMM2 then
    runs tiles twice as wide as moekit's)."""
    if cfg.GEMV:
        return None, f"the GEMV path (GEMV={cfg.GEMV}) has no vLLM counterpart"
    if cfg.OVERLAP2:
        return None, ("GEMM2 in Gluon with the FP8 promotion overlapped (OVERLAP2=1): its time is that kernel's, "
                      "which vLLM does not have")
    if cfg.has_gemm2:
        return None, "GEMM2 has a launch config of its own (vLLM runs one config for both GEMMs, one tile per program)"
    if cfg.OVERLAP:
        return None, ("GEMM1 in Gluon with the FP8 promotion overlapped (OVERLAP=1): its time is that kernel's, "
                      "which vLLM does not have")
    if cfg.num_warps not in VLLM_NUM_WARPS:
        return None, (f"num_warps {cfg.num_warps} is beyond vLLM's search space ({' or '.join(map(str, VLLM_NUM_WARPS))}; "
                      "moekit's 16 warps split its gate and up products over four warpgroups, vLLM's one wide tile would not)")
    block_n = 2 * cfg.BLOCK_N
    if block_n > VLLM_MAX_BLOCK_SIZE_N:
        return None, f"BLOCK_SIZE_N {block_n} is beyond vLLM's search space (<= {VLLM_MAX_BLOCK_SIZE_N})"
    if scheme.block and (block_n % scheme.block or cfg.BLOCK_K % scheme.block):
        return None, (
            f"BLOCK_SIZE_N {block_n} / BLOCK_SIZE_K {cfg.BLOCK_K} not multiples of the {scheme.block}-wide "
            "weight blocks (vLLM's rule for block-quantized weights)"
        )
    return {
        "BLOCK_SIZE_M": cfg.BLOCK_M,
        "BLOCK_SIZE_N": block_n,
        "BLOCK_SIZE_K": cfg.BLOCK_K,
        "GROUP_SIZE_M": cfg.GROUP_M,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }, None


def vllm_table(journals: list[dict]) -> tuple[str, dict, list[str]] | None:
    """(file name, {"<M>": config}, notes): per batch size the triton table's config
    (chosen_config) where vLLM can take it (see vllm_config), else the fastest measured that it
    can; notes say where the table's config is not exported, or none could be."""
    if not journals:
        return None
    problem, fp = journals[-1]["problem"], journals[-1]["fingerprint"]
    scheme = get_scheme(problem["scheme"])
    table: dict[str, dict] = {}
    notes = []
    for j in journals:
        chosen = chosen_config(j)
        ran = sorted((v["us"], k) for k, v in j["configs"].items() if "us" in v and k != chosen[0]) if chosen else []
        ranked = [chosen[0], *(k for _, k in ran)] if chosen else []  # the table's config, then by time
        for rank, key in enumerate(ranked):
            cfg, why = vllm_config(KernelConfig.from_dict(j["configs"][key]["config"]), scheme)
            if cfg is None:
                if rank == 0:
                    notes.append(f"M={j['batch_size']}: the table's config {key} not exported ({why})")
                continue
            table[str(j["batch_size"])] = cfg
            if rank:
                notes.append(f"M={j['batch_size']}: exported {key}, the fastest that vLLM can take")
            break
        else:
            if ran:
                notes.append(f"M={j['batch_size']}: no measured config that vLLM can take")
    if not table:
        return None
    other_group = [m for m, c in table.items() if c["GROUP_SIZE_M"] not in VLLM_GROUP_SIZE_M]
    if other_group:
        values = sorted({table[m]["GROUP_SIZE_M"] for m in other_group})
        notes.append(f"M={', '.join(other_group)}: GROUP_SIZE_M {', '.join(map(str, values))} exported as measured, "
                     f"though vLLM's tuner searches only {', '.join(map(str, VLLM_GROUP_SIZE_M))} "
                     "(its kernel takes any: the value only orders the tiles)")
    name = vllm_file_name(problem["num_experts"], problem["intermediate"], fp["device_name"], scheme)
    return name, table, notes


# ------------------------------------------------------------------------------- writing


def write_tables(
    out_dir: Path, table_file: str, journals: list[dict], run_meta: dict | None = None, export_dir: Path | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[list[Path], list[str]]:
    """Write the tables of one (device, shape, scheme) from its journals: (paths, notes). A file
    replaced is first kept where something of it would be lost (module docstring), said to `log`."""
    log = log or (lambda text: None)
    record = WrittenRecord(Path(out_dir) / ".progress" / WRITTEN_RECORD)
    source = {"table": table_file, **journals[-1]["problem"]}  # what writes these files (WrittenRecord)
    written, notes = [], []
    triton = triton_table(journals, run_meta)
    if triton is not None:
        written.append(_write_keeping(Path(out_dir) / "triton" / table_file, triton, "configs", record, source, log))
    left_out: dict[int, list[str]] = {}
    backends = backend_table(journals, left_out)
    backend_path = Path(out_dir) / "backends" / table_file
    if backends is not None:
        written.append(_write_keeping(backend_path, backends, "batch_sizes", record, source, log))
    elif backend_path.exists():
        # no size decided now: an earlier table must not answer for sizes this rebuild leaves
        # undecided (as a new table would replace it, it is kept, but under a name no lookup reads)
        kept = _backup_name(backend_path)
        backend_path.replace(kept)
        record.forget(backend_path)
        log(f"kept the previous {backend_path} as {kept.name}: no batch size is decided in the new one")
    if left_out:
        notes.append(_undecided_note(left_out, backends))
    if export_dir is not None:
        exported = vllm_table(journals)
        if exported is not None:
            name, table, vllm_notes = exported
            ordered = dict(sorted(table.items(), key=lambda kv: int(kv[0])))
            # vLLM's file names have no accumulation mode: a fast-mode tune's export goes to fast/
            fast = journals[-1]["fingerprint"].get("fp8_accumulation") == "fast"
            written.append(_write_keeping(Path(export_dir) / ("fast" if fast else "") / name, ordered, None, record,
                                          source, log))
            notes += [f"vLLM export: {n}" for n in vllm_notes]
    return written, notes


def _undecided_note(left_out: dict[int, list[str]], backends: dict | None) -> str:
    """What auto does at the sizes the decision table leaves undecided (backend_table): between
    decided sizes it interpolates them (decisions.BackendTable.locate); beyond them, and where
    no size is decided (no table written here), another decision table found for the problem
    answers (a shipped one, one of another MOEKIT_CONFIG_DIR folder, one borrowed from a GPU of
    the sharing group: the tables are layered, moekit.decisions), else, beyond the decided
    sizes, the nearest of them, and with no table at all auto's heuristic."""
    sizes = ", ".join(f"M={M} ({', '.join(names)} not timed)" for M, names in sorted(left_out.items()))
    rerun = "until a rerun of those sizes times them"
    if backends is None:
        return (f"decision table: no batch size decided, none written (left undecided at {sizes}); auto answers "
                "from another decision table it finds for this problem (a shipped one, another MOEKIT_CONFIG_DIR "
                f"folder's), else from its heuristic, {rerun}")
    decided = sorted(int(m) for m in backends["batch_sizes"])
    beyond = [M for M in left_out if not decided[0] < M < decided[-1]]
    where = "from the decided sizes around them"
    if beyond:
        where += (f" (beyond the decided M={decided[0]}" + (f"-{decided[-1]}" if len(decided) > 1 else "")
                  + ": from another decision table found for this problem there, else the nearest decided size)")
    return f"decision table: left undecided at {sizes}; auto answers there {where} {rerun}"


class WrittenRecord:
    """OUT/.progress/written.json: for each file tune writes (its resolved path), what it last
    wrote there, so that a rewrite keeps (`_write_keeping`) only files that are not its own:
    {"sha256": digest of the content (_digest), "replacing": that of the file it replaced,
     "source": {"table": moekit table name, "num_experts", "hidden", "intermediate", "top_k",
                "scheme"}: the problem whose tables wrote it}.
    Saved (atomically) at every change, before the file itself is replaced: an interrupt at any
    point leaves the file either the one replaced or the new one, and the record knows both. (It
    was saved once after all of a problem's files: an interrupt between left tune's own tables
    unknown to the record, and the next rebuild kept them as .bak files, "edited, or from
    elsewhere".) A record of an older moekit holds the sha256 of the file's bytes alone."""

    def __init__(self, path: Path):
        self.path = path
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = {}
        self.data = data if isinstance(data, dict) else {}

    def get(self, path: Path) -> dict | None:
        entry = self.data.get(str(path.resolve()))
        if isinstance(entry, str):  # an older moekit's: the sha256 of the bytes, no source
            return {"file_sha256": entry}
        return entry if isinstance(entry, dict) else None

    def set(self, path: Path, entry: dict) -> None:
        self.data[str(path.resolve())] = entry
        write_json_atomically(self.path, self.data)

    def forget(self, path: Path) -> None:
        if self.data.pop(str(path.resolve()), None) is not None:
            write_json_atomically(self.path, self.data)


def _digest(doc) -> str:
    """sha256 of a JSON document's content (keys sorted, no spaces): the same for the document
    tune is about to write and for that file read back, whatever the writer's layout."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _describe_source(source: dict) -> str:
    return f"{source.get('table', '?').removesuffix('.json')} with top-{source.get('top_k', '?')}"


def _write_keeping(path: Path, doc: dict, sizes_field: str | None, record: WrittenRecord, source: dict,
                   log: Callable[[str], None]) -> Path:
    """Write `doc` to `path`, first copying the file there to <name>.bak-<date>-<time> if anything of
    it would be lost: it is not what tune last wrote there (`record`), tune wrote it for another
    problem (the vLLM file of another scheme, or of another hidden size: vLLM's names have
    neither), or it has batch sizes that `doc` has not (the keys of doc[sizes_field], of doc
    itself when None). `source`: the problem writing it now, recorded."""
    try:
        old = path.read_bytes()
    except FileNotFoundError:
        old = None
    entry: dict = {"sha256": _digest(doc)}
    if old is not None:
        try:
            old_doc = json.loads(old)
        except ValueError:
            old_doc = None
        else:
            entry["replacing"] = _digest(old_doc)  # recognised as tune's own if an interrupt leaves it there
        why = _why_keep(path, old, old_doc, doc, sizes_field, record.get(path), source)
        if why is not None:
            kept = _backup_name(path)
            shutil.copy2(path, kept)
            log(f"kept the previous {path} as {kept.name}: {why}")
    record.set(path, {**entry, "source": source})
    write_json_atomically(path, doc)
    return path


def _why_keep(path: Path, old: bytes, old_doc, doc: dict, sizes_field: str | None, last: dict | None,
              source: dict) -> str | None:
    """Why the file at `path` (`old`, parsed: `old_doc`) must be kept before `doc` replaces it (see
    _write_keeping), or None. `last`: the record of what tune last wrote there."""
    if last is None:
        own = False
    elif "file_sha256" in last:  # an older moekit's record
        own = hashlib.sha256(old).hexdigest() == last["file_sha256"]
    else:
        own = old_doc is not None and _digest(old_doc) in (last.get("sha256"), last.get("replacing"))
    if not own:
        return "not the file tune last wrote there (edited, or from elsewhere)"
    wrote_for = (last or {}).get("source")
    if wrote_for is None and path.name != source["table"]:  # a moekit table's name says its problem; vLLM's does not
        return "tune wrote it, but a moekit that did not record for which problem (it may be another scheme's)"
    if wrote_for is not None and wrote_for != source:
        return (f"tune wrote it for another problem, {_describe_source(wrote_for)} "
                f"(this run: {_describe_source(source)})")
    if not isinstance(old_doc, dict):
        return "not a JSON object"
    lost = sorted(_sizes(old_doc, sizes_field) - _sizes(doc, sizes_field), key=int)
    if lost:
        return f"the new one lacks M={', '.join(lost)}"
    return None


def _sizes(doc: dict, field: str | None) -> set[str]:
    """The batch sizes of a table: the keys of doc[field], of doc itself (the vLLM file) when None."""
    return set(doc if field is None else doc.get(field, {}))


def _backup_name(path: Path) -> Path:
    """<name>.bak-<date>-<time>, -2, -3... if taken: never an earlier copy. Not *.json, so that no
    table lookup (moekit.tables.find_tables) takes it for a table."""
    stem = f"{path.name}.bak-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    n, kept = 1, path.with_name(stem)
    while kept.exists():
        n += 1
        kept = path.with_name(f"{stem}-{n}")
    return kept


__all__ = [
    "BACKEND_TABLE_FORMAT",
    "BACKEND_TABLE_VERSION",
    "backend_table",
    "best_config",
    "chosen_config",
    "decision_candidates",
    "decision_is_current",
    "incumbent_key",
    "triton_table",
    "undecided",
    "vllm_config",
    "vllm_device_name",
    "vllm_file_name",
    "vllm_table",
    "write_tables",
]
