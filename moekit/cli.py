"""The `moekit` command line: thin argument parsing over the library."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

console = Console()


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


INTERRUPTED = 130  # the shell's status for a process ended by Ctrl-C (128 + SIGINT)
OVERWRITE_HELP = "replace the results of an earlier run in --out (default: refuse, so that none is lost)"


def cmd_info(args) -> int:
    import torch
    import triton

    import moekit
    from moekit.backends import backend_names, get_backend
    from moekit.spec import SCHEMES, MoEShape

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        cap = torch.cuda.get_device_capability()
        console.print(f"device: {torch.cuda.get_device_name()} (compute capability {cap[0]}.{cap[1]})")
    else:
        console.print("device: CPU (no CUDA GPU visible)")
    console.print(f"moekit {moekit.__version__}, torch {torch.__version__}, triton {triton.__version__}")
    from moekit.backends.triton.launch import FP8_ACCUMULATION_ENV, PDL_ENV, fp8_accumulation, pdl_enabled, pdl_wanted

    from moekit.select import ENV_VAR as BACKEND_ENV, environment_backend

    try:
        accumulation = fp8_accumulation()
        pdl = "on" if pdl_enabled(device) else "off" if not pdl_wanted() else \
            "unavailable here (needs a Hopper or newer GPU and a Triton with griddepcontrol)"
        forced = environment_backend()
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    console.print(f"triton backend: FP8 accumulation {accumulation} ({FP8_ACCUMULATION_ENV}), "
                  f"programmatic dependent launch {pdl} ({PDL_ENV})")
    console.print(f"backend of calls that leave it to auto: {forced} ({BACKEND_ENV})" if forced else
                  f"backend of calls that leave it to auto: chosen per call ({BACKEND_ENV} unset)")
    from moekit.routing import _use_kernel

    on_kernel = _use_kernel(torch.empty(1, 1, device=device))  # route()'s own rule, for logits here
    console.print("moekit.route here: " + ("one Triton kernel (docs/routing.md)" if on_kernel else
                                           "torch ops (the routing kernel runs on a GPU)"))
    # A representative problem per scheme: dimensions every kernel accepts (multiples of 128), so
    # that what a backend refuses is the scheme or this machine, not the shape.
    shape = MoEShape(8, 4096, 1024, 2)
    schemes = [s for name, s in SCHEMES.items() if name != "fp16"]  # fp16 is bf16's scheme
    table = Table(title=f"backends on {device.type} by scheme ({shape.describe()}; a real model's shape may add "
                        "conditions: `moekit select` answers for one)")
    table.add_column("backend")
    for s in schemes:
        table.add_column(s.name, justify="center")
    table.add_column("description")
    why: dict[str, dict[str, list[str]]] = {}
    for name in backend_names():
        backend = get_backend(name)
        refused = {s.name: backend.supports(shape, s, device) for s in schemes}
        why[name] = {k: v for k, v in refused.items() if v}
        table.add_row(name, *("[red]no[/]" if refused[s.name] else "[green]yes[/]" for s in schemes), backend.description)
    from moekit.bench import print_wide

    print_wide(console, table)  # in a pipe rich assumes 80 columns and would cut the names
    for name, by_scheme in why.items():
        # a reason every scheme gets (no CUDA device, say) is said once, then each scheme's own
        common = []
        if len(by_scheme) == len(schemes):
            first, *others = by_scheme.values()
            common = [r for r in first if all(r in rs for rs in others)]
        if common:
            console.print(f"{name}: {'; '.join(common)}", highlight=False, soft_wrap=True)
        for scheme_name, rs in by_scheme.items():
            own = [r for r in rs if r not in common]
            if own:
                console.print(f"{name}, {scheme_name}: {'; '.join(own)}", highlight=False, soft_wrap=True)
    return 0


def cmd_models(args) -> int:
    from moekit.models import PRESETS

    table = Table(title="model presets")
    for col in ("name", "experts", "hidden", "intermediate", "top-k", "shared", "MoE layers", "scheme", "routing"):
        table.add_column(col, justify="right" if col not in ("name", "scheme", "routing") else "left")
    for name, spec in PRESETS.items():
        s, r = spec.shape, spec.routing
        routing = r.scoring + (" grouped" if r.num_groups and r.num_groups > 1 else "") + (
            " on input" if r.apply_on_input else ""
        )
        table.add_row(
            name, str(s.num_experts), str(s.hidden), str(s.intermediate), str(s.top_k),
            str(s.shared_experts), str(s.num_layers), spec.scheme.name, routing,
        )
    from moekit.bench import print_wide

    print_wide(console, table)
    return 0


DTYPE_HELP = "activation dtype: bf16 (bfloat16) or fp16 (float16) (default: bf16)"


def activation_dtype(value: str) -> str:
    """--dtype's type: moekit's name of the activation dtype. vLLM's tuning scripts use --dtype for
    the weights' quantization (fp8_w8a8, ...), which moekit calls the scheme: say so."""
    from moekit.dtypes import DTYPE_SPELLINGS  # imported here: it imports torch, which --help does not need

    name = DTYPE_SPELLINGS.get(value.lower())
    if name is not None:
        return name
    hint = ("; the quantization is --scheme here (e.g. --scheme fp8-channel-token, see `moekit models`)"
            if "fp8" in value.lower() or "int8" in value.lower() or "w8a8" in value.lower() else "")
    raise argparse.ArgumentTypeError(f"{value!r} is not an activation dtype: expected bf16 or fp16{hint}")


# vLLM's spellings too (--tensor-parallel-size in vllm serve; --tp-size and -tp in its
# benchmark_moe.py and tuning scripts), so that their command lines carry over unchanged.
TP_FLAGS = ("--tp", "--tp-size", "-tp", "--tensor-parallel-size")


def _add_model_args(
    p: argparse.ArgumentParser,
    batch_help: str,
    backends_help: str,
    out_help: str = "output folder (default: a timestamped one under moekit-results/)",
    scheme_help: str = "quantization scheme (default: the model's own)",
) -> None:
    p.add_argument("--model", action="append", required=True, metavar="NAME|PATH",
                   help="a preset name (see `moekit models`) or a config.json / model folder; repeatable")
    p.add_argument(*TP_FLAGS, dest="tp", type=int, default=1,
                   help="tensor parallelism: the experts' intermediate size is split over this many GPUs (default: 1)")
    p.add_argument("--scheme", default=None, help=scheme_help)
    p.add_argument("--batch-sizes", "--batch-size", dest="batch_sizes", nargs="+", action="extend", metavar="M", default=None,
                   help=batch_help)
    p.add_argument("--backends", nargs="+", action="extend", metavar="NAME", default=None, help=backends_help)
    p.add_argument("--out", default=None, help=out_help)
    p.add_argument("--seed", type=int, default=0, help="random seed of weights, inputs and routing (default: 0)")
    p.add_argument("--dtype", type=activation_dtype, default="bf16", help=DTYPE_HELP)


def cmd_bench(args) -> int:
    from moekit.bench import BenchInputError, BenchOptions, run_bench

    opts = BenchOptions(
        models=args.model, tp=args.tp, scheme=args.scheme, batch_sizes=args.batch_sizes,
        backends=args.backends, baseline=args.baseline, mode=args.mode, routing=args.routing,
        check=not args.no_check, out=args.out, seed=args.seed, dtype=args.dtype, reps=args.reps,
        warmup=args.warmup, routings=args.routings, l2_flush=args.l2_flush, model_estimate=args.model_estimate,
        plots=not args.no_plots,
        refresh_ceilings=args.refresh_ceilings, overwrite=args.overwrite, argv=getattr(args, "argv", None),
    )
    try:
        result = run_bench(opts, console)
    except BenchInputError as e:
        raise UsageError(str(e)) from None
    if result.interrupted:
        return INTERRUPTED
    return 1 if result.errors else 0


def cmd_check(args) -> int:
    from moekit.bench import BenchInputError
    from moekit.check import CheckOptions, run_check

    opts = CheckOptions(
        models=args.model, tp=args.tp, scheme=args.scheme, batch_sizes=args.batch_sizes,
        backends=args.backends, seeds=args.seeds, seed=args.seed, out=args.out, dtype=args.dtype,
        overwrite=args.overwrite, argv=getattr(args, "argv", None),
    )
    try:
        report = run_check(opts, console)
    except BenchInputError as e:
        raise UsageError(str(e)) from None
    if report.interrupted:
        return INTERRUPTED
    return 0 if report.passed else 1


def cmd_tune(args) -> int:
    from moekit.bench import BenchInputError
    from moekit.tune import TuneOptions, run_tune

    opts = TuneOptions(
        models=args.model, tp=args.tp, scheme=args.scheme, batch_sizes=args.batch_sizes, backends=args.backends,
        budget=args.budget, out=args.out, routing=args.routing, search_space=args.search_space, reps=args.reps,
        warmup=args.warmup, seed=args.seed, dtype=args.dtype, export_vllm=args.export_vllm,
        compile_workers=args.compile_workers, between=args.between, routings=args.routings,
        gemm2=args.gemm2_search, argv=getattr(args, "argv", None),
    )
    try:
        return run_tune(opts, console).exit_code
    except BenchInputError as e:
        raise UsageError(str(e)) from None


def cmd_select(args) -> int:
    import torch

    from moekit.bench import MAX_BATCH_SIZE
    from moekit.dtypes import ACTIVATION_DTYPES
    from moekit.models import get_model
    from moekit.select import BackendUnavailableError, DeviceSpec, explain
    from moekit.spec import get_scheme

    def positive(flag, value):
        if value is None or not (str(value).isascii() and str(value).isdigit()) or int(value) < 1:
            raise UsageError(f"{flag} must be a positive integer, got {value!r}")
        return int(value)

    batch, tp = positive("--batch-size", args.batch_size), positive("--tp", args.tp)
    if batch > MAX_BATCH_SIZE:
        raise UsageError(f"--batch-size: {batch} is above {MAX_BATCH_SIZE}, the largest batch size moekit takes "
                         "(moekit.bench.MAX_BATCH_SIZE)")
    try:
        spec = get_model(args.model, tp=tp)
        scheme = get_scheme(args.scheme) if args.scheme else spec.scheme
        if scheme.weight == "block" and spec.shape.n % 128:
            raise ValueError(f"scheme {scheme.name} needs the intermediate size per GPU to be a multiple of 128, got {spec.shape.n}")
        if args.device_name is not None:
            device = DeviceSpec.from_name(args.device_name)
        else:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        lines = explain(spec.shape, scheme, device, ACTIVATION_DTYPES[args.dtype], batch, args.backend or "auto")
    except BackendUnavailableError as e:
        raise UsageError(_unavailable(e, "this problem")) from None
    except (ValueError, OSError) as e:
        raise UsageError(" ".join(str(e).split())) from None
    if isinstance(device, DeviceSpec):
        where = str(device)
    else:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (no CUDA GPU visible)"
    rows = batch * spec.shape.top_k / spec.shape.num_experts
    head = [f"model: {spec.name}: {spec.shape.describe()}, {scheme.name}, {args.dtype} activations",
            f"device: {where}", f"batch size: {batch} ({rows:g} rows per expert)"]
    for line in head + lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    return 0


def _unavailable(e, what: str) -> str:
    """A BackendUnavailableError in the command line's words, naming where the backend came from:
    --backend, or MOEKIT_BACKEND when the command line named none (else the user is left to guess)."""
    source = "--backend" if e.source == "argument" else e.source
    return (f"backend {e.name!r} (from {source}) cannot run {what}: {'; '.join(e.reasons)} "
            f"(backends that can: {', '.join(e.runnable) or 'none'})")


def cmd_warmup(args) -> int:
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from moekit.bench import parse_batch_sizes
    from moekit.compile_ahead import batch_sizes_to_warm, warmup
    from moekit.models import get_model
    from moekit.dtypes import ACTIVATION_DTYPES
    from moekit.select import BackendUnavailableError
    from moekit.spec import get_scheme
    from moekit.weights import check_intermediate, empty_weights

    if args.tp < 1:
        raise UsageError(f"--tp must be a positive integer, got {args.tp}")
    dtype = ACTIVATION_DTYPES[args.dtype]
    if args.batch_sizes and args.max_batch_size is not None:
        raise UsageError("give --max-batch-size (every size from 1 to it) or --batch-sizes, not both")
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise UsageError(f"--max-batch-size must be a positive integer, got {args.max_batch_size}")
    try:
        listed = parse_batch_sizes(args.batch_sizes, ()) if args.batch_sizes else None
        sizes = batch_sizes_to_warm(None if listed else (8192 if args.max_batch_size is None else args.max_batch_size), listed)
        problems = []
        for name in args.model:  # every model checked before the first compiles
            spec = get_model(name, tp=args.tp)
            scheme = get_scheme(args.scheme) if args.scheme else spec.scheme
            check_intermediate(scheme, spec.shape.n)
            problems.append((spec, scheme))
    except ValueError as e:  # BenchInputError too
        raise UsageError(" ".join(str(e).split())) from None
    if not torch.cuda.is_available():
        raise UsageError("moekit warmup compiles GPU kernels: no CUDA GPU is visible here")
    device = torch.device("cuda")
    table = Table(title=f"moekit warmup on {torch.cuda.get_device_name(device)}")
    for head in ("model", "scheme", "compiled", "no Triton kernels of its own", "new kernel variants", "seconds"):
        table.add_column(head, justify="right" if head in ("new kernel variants", "seconds") else "left")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    for spec, scheme in problems:
        try:
            weights = empty_weights(spec.shape, scheme, device, dtype)  # never read: nothing is launched
        except torch.cuda.OutOfMemoryError:
            raise UsageError(f"{spec.name}: its expert weights do not fit this GPU's free memory "
                             "(warm with a larger --tp, as the server shards them)") from None
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task(f"{spec.name} ({scheme.name})", total=len(sizes))
            try:
                report = warmup(weights, spec.shape.top_k, batch_sizes=sizes, dtype=dtype, backend=args.backend,
                                on_size=lambda M: progress.advance(task))
            except BackendUnavailableError as e:
                raise UsageError(_unavailable(e, spec.name)) from None
            except ValueError as e:
                raise UsageError(f"{spec.name}: {' '.join(str(e).split())}") from None
        def per_backend(names):
            return "; ".join(f"{b}: {_ranges(report.sizes[b])}" for b in sorted(names)) or "-"

        table.add_row(spec.name, scheme.name, per_backend(report.compiled),
                      per_backend(set(report.sizes) - set(report.compiled)),
                      "?" if report.new_variants is None else str(report.new_variants), f"{report.seconds:.1f}")
        del weights
    console.print(table)
    return 0


def _ranges(sizes) -> str:
    """1, 2, 3, 5, 6 -> '1-3, 5-6'."""
    runs: list[list[int]] = []
    for m in sorted(sizes):
        if runs and m == runs[-1][1] + 1:
            runs[-1][1] = m
        else:
            runs.append([m, m])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


# the `hf` extra's packages (pyproject.toml), which moekit eval imports
HF_EXTRA_MODULES = ("transformers", "safetensors", "compressed_tensors", "accelerate")


def cmd_eval(args) -> int:
    try:
        from moekit.hf.eval import EvalInputError, EvalOptions, run_eval  # imports transformers: only here
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] not in HF_EXTRA_MODULES:
            raise
        raise UsageError(f"moekit eval needs {e.name.split('.')[0]}: pip install 'moekit[hf]'") from None

    opts = EvalOptions(
        model=args.model, backends=args.backends, text=args.text, max_tokens=args.max_tokens,
        gen_tokens=args.gen_tokens, seq_len=args.seq_len, scheme=args.scheme, out=args.out,
        fused_routing=args.fused_routing, overwrite=args.overwrite, argv=getattr(args, "argv", None),
    )
    try:
        run_eval(opts, console)
    except EvalInputError as e:
        raise UsageError(str(e)) from None
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse reports a missing required flag before an unrecognized one, so a mistyped flag
    (`--mdoel x`) read as "--model is required" and was never named. parse_args first parses with
    every requirement relaxed and reports an unrecognized flag (with the command's own usage, not
    the top-level one), then parses for real. Not with --help: it exits before any requirement
    is checked, and its usage must show the required flags as required."""

    def parse_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        if not {"-h", "--help"} & set(args):
            relaxed = [a for a in _actions(self) if a.required]
            for a in relaxed:
                a.required = False
            try:
                known, unknown = self.parse_known_args(args, namespace)
            finally:
                for a in relaxed:
                    a.required = True
            # a word alone (`bench mixtral`: --model forgotten) is better told by the missing flag
            if any(u.startswith("-") for u in unknown):
                getattr(known, "subparser", self).error(f"unrecognized arguments: {' '.join(unknown)}")
        return super().parse_args(args, namespace)


def _actions(parser: argparse.ArgumentParser):
    """Every action of the parser and of its subcommands' parsers."""
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _actions(sub)


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: a prefix of a flag is an error, not the flag. With prefixes accepted, a
    # new flag sharing one (--batch-size beside --batch-sizes) changes or breaks old command lines.
    moekit = __import__("moekit")
    parser = _Parser(prog="moekit", description=moekit.__doc__, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"moekit {moekit.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=summary, allow_abbrev=False)
        p.set_defaults(subparser=p)  # _Parser: an unknown flag is reported with this command's usage
        return p

    command("info", "device, versions, and which backends can run here").set_defaults(func=cmd_info)
    command("models", "list the model presets").set_defaults(func=cmd_models)

    bench = command("bench", "time every backend on real model shapes, against the roofline")
    _add_model_args(
        bench,
        "batch sizes in tokens (default: 1 2 4 ... 8192 on a GPU; 1 4 16 64 on the CPU)",
        "backends to time, 'auto' included (default: every one that can run here, plus auto)",
    )
    bench.add_argument("--baseline", default=None,
                       help="backend the speedups are measured against (default: the first of cutlass, torch, "
                            "reference that runs every model here; --mode gemm: cutlass, then triton)")
    bench.add_argument("--mode", choices=("layer", "gemm"), default="layer",
                       help="layer: the whole layer, routing excluded; gemm: the two expert GEMMs alone (default: layer)")
    bench.add_argument("--routing", default="uniform", metavar="uniform|skewed|FILE",
                       help="random top-k, a skewed (Zipf-like) expert popularity, or recorded topk_ids (.pt/.npy) "
                            "(default: uniform)")
    bench.add_argument("--no-check", action="store_true", help="skip the relative error against reference")
    bench.add_argument("--model-estimate", action="store_true",
                       help="add the MoE time per decode step of the whole model (MoE layers x layer time)")
    bench.add_argument("--reps", type=int, default=30, help="timed replays per point (default: 30)")
    bench.add_argument("--warmup", type=int, default=5, help="warm-up calls per point (default: 5)")
    bench.add_argument("--routings", type=int, default=4, metavar="N",
                       help="layer mode: the replays of each point cycle through N routings of its batch size "
                            "(default: 4)")
    bench.add_argument("--l2-flush", choices=("zero", "read"), default="zero",
                       help="how the L2 is emptied before each replay: zero a 512 MiB buffer (default; the method "
                            "of the reference points), or read it, leaving no dirty lines whose write-back "
                            "the replay's first reads pay (6-10 us at decode sizes on an H100)")
    bench.add_argument("--no-plots", action="store_true", help="write no PNG plots (no matplotlib needed)")
    bench.add_argument("--cached-ceilings", action="store_false", dest="refresh_ceilings",
                       help="use the device's copy bandwidth and matmul rates measured by an earlier run "
                            "(default: measured in this run, a few seconds)")
    bench.add_argument("--refresh-ceilings", action="store_true", help=argparse.SUPPRESS)  # the default now
    bench.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    bench.set_defaults(func=cmd_bench)

    check = command("check", "accuracy of every backend against a float64 computation, and of the routing kernel "
                            "against its torch ops")
    _add_model_args(
        check,
        "batch sizes in tokens (default: 1 7 64); a case with idle experts (M=8, half the experts) is added",
        "backends to check (default: every one that can run the model's scheme here)",
    )
    check.add_argument("--seeds", type=int, default=3, help="number of seeds per batch size (default: 3)")
    check.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    check.set_defaults(func=cmd_check)

    tune = command("tune", "search the triton backend's configs and time every backend; write the tables auto reads")
    _add_model_args(
        tune,
        "batch sizes in tokens (default: 1 2 4 ... 8192 on a GPU; 1 4 on the CPU)",
        "backends to time besides triton (default: every one that can run here; on a GPU reference only when "
        "named, on the CPU reference too)",
        "output folder: tables, and the journal a rerun resumes from (default: moekit-results/tune)",
        "quantization scheme, or several comma-separated (e.g. fp8-channel-token,fp8-block128), each tuned "
        "with its own weights and scales (default: the model's own)",
    )
    tune.add_argument("--budget", default=None, metavar="TIME",
                      help="stop cleanly after this long (90s, 10m, 1h, 1h30m, or plain seconds: 600), keeping the "
                           "best found so far (default: no limit)")
    tune.add_argument("--routing", default="uniform", metavar="uniform|skewed|FILE",
                      help="routing of the tuning inputs: random top-k, Zipf-like skew, or recorded topk_ids (.pt/.npy) "
                           "(default: uniform)")
    tune.add_argument("--search-space", choices=("pruned", "full", "none"), default="pruned",
                      help="pruned: skip dominated configs and those >1.5x slower at the next smaller batch size; "
                           "full: every config that can run (exhaustive); none: search nothing, time the "
                           "backends only (with the configs already found in --out) (default: pruned)")
    tune.add_argument("--between", action=argparse.BooleanOptionalAction, default=True,
                      help="also time every backend at a size between each two tuned sizes, for the "
                           "decision table (default: on)")
    tune.add_argument("--gemm2-search", action=argparse.BooleanOptionalAction, default=True,
                      help="after each size's search, time the best config again with GEMM2 launched "
                           "with its own tile width, warps and stages (under --search-space none: the best "
                           "config found before) (default: on)")
    tune.add_argument("--reps", type=int, default=20, help="timed replays per config (default: 20)")
    tune.add_argument("--warmup", type=int, default=3, help="warm-up calls per config, the first compiles (default: 3)")
    tune.add_argument("--routings", type=int, default=4, metavar="N",
                      help="the decision timing (every backend and triton's best config, interleaved) "
                           "cycles through N routings of each batch size (default: 4)")
    tune.add_argument("--compile-workers", type=int, default=None, metavar="N",
                      help="helper processes compiling configs ahead of their measurement "
                           "(default: half the CPU cores, at most 8, on a GPU; 0 on the CPU)")
    tune.add_argument("--export-vllm", default=None, metavar="DIR",
                      help="also write the configs as vLLM fused_moe config files into DIR")
    tune.set_defaults(func=cmd_tune)

    select = command("select", "which backend auto runs for a model and batch size, and why")
    select.add_argument("--model", required=True, metavar="NAME|PATH", help="a preset name or a config.json / model folder (required)")
    select.add_argument(*TP_FLAGS, dest="tp", default="1", help="tensor parallelism (default: 1)")
    select.add_argument("--scheme", default=None, help="quantization scheme (default: the model's own)")
    select.add_argument("--batch-size", required=True, metavar="M", help="tokens in the batch (required)")
    select.add_argument("--device-name", default=None, metavar="NAME",
                        help="answer for this GPU instead of the local device, e.g. 'NVIDIA H100 80GB HBM3' (default: the local device)")
    select.add_argument("--backend", default=None,
                        help="a backend name, as the backend argument would give it (default: none, so MOEKIT_BACKEND, "
                             "then auto)")
    select.add_argument("--dtype", type=activation_dtype, default="bf16", help=DTYPE_HELP)
    select.set_defaults(func=cmd_select)
    warm = command("warmup", "compile the triton kernels a model's MoE layers launch up to a batch size, before serving")
    warm.add_argument("--model", action="append", required=True, metavar="NAME|PATH",
                      help="a preset name (see `moekit models`) or a config.json / model folder; repeatable")
    warm.add_argument(*TP_FLAGS, dest="tp", type=int, default=1, help="tensor parallelism (default: 1)")
    warm.add_argument("--scheme", default=None, help="quantization scheme (default: the model's own)")
    warm.add_argument("--max-batch-size", "--max-num-batched-tokens", dest="max_batch_size", type=int, default=None,
                      metavar="M", help="compile for every batch size (tokens) from 1 to M (default 8192; vLLM's "
                                        "--max-num-batched-tokens is the largest a step runs)")
    warm.add_argument("--batch-sizes", "--batch-size", dest="batch_sizes", nargs="+", action="extend", metavar="M", default=None,
                      help="only these batch sizes (instead of 1 ... --max-batch-size)")
    warm.add_argument("--backend", default="auto",
                      help="as fused_moe's backend argument (default auto: the sizes it gives triton)")
    warm.add_argument("--dtype", type=activation_dtype, default="bf16", help=DTYPE_HELP)
    warm.set_defaults(func=cmd_warmup)
    ev = command("eval", "a local transformers MoE model on each backend: perplexity, KL and top-1 vs reference, tokens/s")
    ev.add_argument("--model", required=True, metavar="PATH", help="a local model folder (config.json, safetensors, tokenizer)")
    ev.add_argument("--backends", nargs="+", action="extend", metavar="NAME", default=None,
                    help="backends to evaluate (default: every one that can run here); reference is always added")
    ev.add_argument("--text", default=None, metavar="FILE", help="text to score (default: moekit/data/eval.txt)")
    ev.add_argument("--max-tokens", type=int, default=512, help="tokens of the text scored (default: 512)")
    ev.add_argument("--seq-len", type=int, default=256, help="tokens per scoring window (default: 256)")
    ev.add_argument("--gen-tokens", type=int, default=32, help="greedy tokens generated for tokens/s, 0 to skip (default: 32)")
    ev.add_argument("--scheme", default=None, help="quantize a bf16 checkpoint's experts on load to this scheme")
    ev.add_argument("--out", default=None, metavar="FILE", help="write the JSON report here (a new file)")
    ev.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    ev.add_argument("--fused-routing", action="store_true",
                    help="also run each backend with transformers' routers fused into moekit.route "
                         "(rows BACKEND+fused-routing, against the unfused reference)")
    ev.set_defaults(func=cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, for reproducibility
    try:
        return args.func(args)
    except UsageError as e:
        from rich.markup import escape

        console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:  # bench and check save what they measured first (*.partial.*)
        console.print("interrupted", highlight=False)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
