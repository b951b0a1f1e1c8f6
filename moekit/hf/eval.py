"""`moekit eval`: a local transformers MoE model with its experts on each moekit backend.

For every backend (the experts change, nothing else does):
  - perplexity on a text (default: moekit/data/eval.txt, chapter 1 of Jane Austen's "Pride and
    Prejudice", 1813, public domain), scored in windows of --seq-len tokens, --max-tokens in all;
  - against the `reference` backend (FP8 math in float32, the ground truth), at every scored
    position: the next-token KL divergence KL(reference || backend) and top-1 agreement; the
    same two numbers for every pair of backends;
  - tokens/s of greedy generation (--gen-tokens new tokens after a 16-token prompt of the text,
    after one warm-up generation), and how many generated tokens match the reference's.
A rich table on the console; the whole report as JSON with --out.

The options (backend names, scheme, --out) are checked before the model loads, so that a typo
costs no load and an unwritable --out no evaluation; whether a named backend can run the model is
known only once it is loaded. `--scheme fp8-tensor-static` applies only to checkpoints stored so:
quantizing a bf16 checkpoint to it needs calibration text, which the command line does not take.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path

import torch

from ..tables import write_json_atomically

DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "data" / "eval.txt"
PROMPT_TOKENS = 16
FUSED_SUFFIX = "+fused-routing"  # the row of a backend run with the routers fused


class EvalInputError(ValueError):
    """Bad input to moekit eval: printed as one line by the CLI."""


@dataclasses.dataclass
class EvalOptions:
    model: str
    backends: list[str] | None = None
    text: str | None = None
    max_tokens: int = 512
    gen_tokens: int = 32
    seq_len: int = 256
    scheme: str | None = None
    out: str | None = None
    device: str | None = None
    fused_routing: bool = False  # also run each backend with the routers fused (routers.py)
    overwrite: bool = False  # replace an existing --out file
    argv: list[str] | None = None


def _device(opts: EvalOptions) -> torch.device:
    if opts.device:
        return torch.device(opts.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _check_backend_names(requested) -> None:
    from ..backends import backend_names

    names = backend_names()
    unknown = [b for b in requested or () if b not in names]
    if unknown:
        raise EvalInputError(f"--backends: unknown backend {unknown[0]!r}; expected one of: {', '.join(names)}")


def _check_scheme(name: str | None, folder: Path):
    """The scheme --scheme names (None: the checkpoint's own), refused now, in the command line's
    terms, where from_pretrained would refuse it in its own (scheme=None, calibration=)."""
    from ..spec import get_scheme
    from transformers import AutoConfig

    from .families import UnsupportedModelError, family_of_config
    from .load import _checkpoint_schemes, _fp8_not_converted

    if name is None:
        return None
    try:
        scheme = get_scheme(name)
    except ValueError as e:
        raise EvalInputError(f"--scheme: {e}") from None
    try:  # each experts module's scheme, as from_pretrained reads them
        schemes = _checkpoint_schemes(folder, family_of_config(AutoConfig.from_pretrained(folder)))
    except (UnsupportedModelError, ValueError) as e:
        raise EvalInputError(" ".join(str(e).split())) from None
    refused = _fp8_not_converted(schemes, scheme)
    if refused:
        raise EvalInputError(
            f"--scheme {scheme.name}: the checkpoint's experts {refused[0]} are {refused[1].name}, and FP8 experts "
            "are loaded as stored; leave out --scheme"
        )
    if scheme.static_activation and any(not s.is_fp8 for s in schemes.values()):
        raise EvalInputError(
            f"--scheme {scheme.name}: quantizing an unquantized checkpoint to it needs calibration text for "
            "its static activation scales, which moekit eval does not take; use --scheme fp8-tensor-dynamic, "
            f"or quantize in Python (moekit.hf.from_pretrained(path, scheme={scheme.name!r}, calibration=text), "
            "then moekit.hf.save_pretrained) and evaluate the saved folder"
        )
    return scheme


def _check_out(out: str | None, overwrite: bool = False) -> Path | None:
    """The report's path, proven writable now (not after the whole evaluation, losing it) without
    creating anything: the folders it needs are made when the report is written, so that bad
    input or a model that fails to load leaves no folder behind. An existing file is replaced only
    with --overwrite."""
    if not out:
        return None
    path = Path(out).expanduser()
    if path.is_dir():
        raise EvalInputError(f"--out {path}: is a folder; give the report's file name, e.g. {path / 'eval.json'}")
    if path.exists() and not overwrite:
        raise EvalInputError(f"--out {path}: the file exists; pass --overwrite to replace it")
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise EvalInputError(f"--out {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):  # the report is written beside, then renamed over
        raise EvalInputError(f"--out {path}: cannot write there (no write permission in {existing})")
    return path


def _plan_backends(requested, weights, device, dtype) -> list[str]:
    """reference first, then the requested backends (default: every one that can run here, but
    on the CPU not those that run there only in the Triton interpreter: bench's rule, far too
    slow for a default run; named, they run)."""
    from ..backends import backend_names, get_backend
    from ..bench import INTERPRETED_ON_CPU

    shape = weights.shape(1)
    names = backend_names()
    if requested:
        for b in requested:
            reasons = get_backend(b).supports(shape, weights.scheme, device, dtype)
            if reasons:
                raise EvalInputError(f"backend {b!r} cannot run this model here: {'; '.join(reasons)}")
        chosen = list(dict.fromkeys(requested))
    else:
        chosen = [b for b in names if not get_backend(b).supports(shape, weights.scheme, device, dtype)
                  and not (device.type == "cpu" and b in INTERPRETED_ON_CPU)]
    return ["reference"] + [b for b in chosen if b != "reference"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _score(model, ids: torch.Tensor, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [P, V] float32 on the CPU, next-token NLL [P]) over windows of seq_len tokens."""
    logps, nlls = [], []
    for start in range(0, ids.numel() - 1, seq_len):
        window = ids[start : start + seq_len + 1]
        if window.numel() < 2:
            break
        logits = model(input_ids=window[None, :-1].to(device)).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1).cpu()
        logps.append(lp)
        nlls.append(-lp.gather(1, window[1:, None]).squeeze(1))
    return torch.cat(logps), torch.cat(nlls)


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """KL(a || b) per position (mean and max) and top-1 agreement of two log-prob matrices."""
    kl = (a.exp() * (a - b)).sum(dim=-1).clamp(min=0)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean())}


@torch.no_grad()
def _generate(model, prompt: torch.Tensor, n: int, device) -> tuple[list[int], float]:
    kw = dict(do_sample=False, pad_token_id=getattr(model.generation_config, "pad_token_id", None) or 0)
    model.generate(prompt.to(device), max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(prompt.to(device), max_new_tokens=n, min_new_tokens=n, **kw)
    _sync(device)
    elapsed = time.perf_counter() - t0
    new = out[0, prompt.shape[1]:].tolist()
    return new, len(new) / elapsed if elapsed > 0 else float("inf")


def run_eval(opts: EvalOptions, console=None) -> dict:
    from rich.table import Table

    import moekit.hf as mh
    from transformers import AutoTokenizer

    from safetensors import SafetensorError

    from ..bench import check_environment, environment
    from .experts import ExpertsError
    from .families import UnsupportedModelError
    from .load import EmptyTokenizerError, _encode
    from .routers import fuse_routers, routers_to_fuse, unfuse_routers

    try:  # bench's, check's and tune's check: refused before the model loads, not after
        check_environment()
    except ValueError as e:
        raise EvalInputError(str(e)) from None
    if opts.max_tokens < 2:
        raise EvalInputError(f"--max-tokens must be at least 2, got {opts.max_tokens}")
    if opts.seq_len < 1 or opts.gen_tokens < 0:
        raise EvalInputError("--seq-len must be >= 1 and --gen-tokens >= 0")
    folder = Path(opts.model)
    if not (folder / "config.json").is_file():
        raise EvalInputError(f"--model {opts.model!r} is not a local model folder (no config.json)")
    _check_backend_names(opts.backends)
    scheme = _check_scheme(opts.scheme, folder)
    out = _check_out(opts.out, opts.overwrite)  # creates nothing: the report's folders come with it
    text_path = Path(opts.text) if opts.text else DEFAULT_TEXT
    if not text_path.is_file():
        why = "is not a file" if text_path.exists() else "no such file"
        raise EvalInputError(f"--text {str(text_path)!r}: {why}")
    try:
        text = text_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise EvalInputError(f"--text {str(text_path)!r}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise EvalInputError(f"--text {str(text_path)!r}: cannot read it ({e.strerror or e})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as e:
        # one line: transformers' messages run over several (the CLI's errors are one line)
        raise EvalInputError(f"{opts.model}: no usable tokenizer in the model folder ({type(e).__name__}: "
                             f"{' '.join(str(e).split())})") from None
    try:
        ids = _encode(tokenizer, text, folder)[0, : opts.max_tokens]
    except EmptyTokenizerError as e:  # not the text's fault, as "fewer than 2 tokens" below would say
        raise EvalInputError(f"{e}; add them to the folder (moekit.hf.save_pretrained does not write the "
                             "tokenizer: save it with the tokenizer's own save_pretrained)") from None
    if ids.numel() < 2:
        raise EvalInputError(f"{text_path}: fewer than 2 tokens to score")

    device = _device(opts)
    meta = environment(device, opts.argv)  # bench.json's and check.json's: versions, git commit, date, command
    kwargs = {"device_map": str(device)} if device.type == "cuda" else {}
    try:
        model = mh.from_pretrained(folder, backend="reference", scheme=scheme, **kwargs)
    except (UnsupportedModelError, ExpertsError) as e:  # a model moekit cannot run, named with the reason
        raise EvalInputError(" ".join(str(e).split())) from None
    except (OSError, ValueError, SafetensorError) as e:  # no weights, a truncated safetensors file ...
        raise EvalInputError(f"--model {opts.model!r}: cannot load the model ({type(e).__name__}: "
                             f"{' '.join(str(e).split())})") from None
    model.to(device)
    modules = mh.experts_modules(model)
    first = next(iter(modules.values())).moe_weights()
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    backends = _plan_backends(opts.backends, first, device, dtype)

    results: dict[str, dict] = {}
    logps: dict[str, torch.Tensor] = {}
    prompt = ids[None, :PROMPT_TOKENS]
    runs = [(b, False) for b in backends]
    if opts.fused_routing:  # a second row per backend; "reference" (unfused) stays every row's baseline
        try:
            routers_to_fuse(model)  # each router checked against transformers' once, before any run
        except UnsupportedModelError as e:
            raise EvalInputError(" ".join(str(e).split())) from None
        runs += [(b, True) for b in backends]
    for b, fused in runs:
        if fused:
            fuse_routers(model, check=False)
        else:
            unfuse_routers(model)
        label = f"{b}{FUSED_SUFFIX}" if fused else b
        mh.set_backend(model, b)
        t0 = time.perf_counter()
        lp, nll = _score(model, ids, opts.seq_len, device)
        score_s = time.perf_counter() - t0
        logps[label] = lp
        r = {"perplexity": math.exp(float(nll.mean())), "mean_nll": float(nll.mean()), "score_seconds": score_s,
             "backend": b, "fused_routing": fused}
        if opts.gen_tokens:
            new, tps = _generate(model, prompt, opts.gen_tokens, device)
            r.update(tokens_per_s=tps, generated=new)
        results[label] = r
        if console is not None:
            console.print(f"  {label}: perplexity {r['perplexity']:.3f}" + (f", {r['tokens_per_s']:.1f} tokens/s" if opts.gen_tokens else ""))
    ref = logps["reference"]
    for b, r in results.items():
        r.update({f"{k}_vs_reference": v for k, v in _compare(ref, logps[b]).items()})
        if opts.gen_tokens:
            same = sum(x == y for x, y in zip(results["reference"]["generated"], r["generated"]))
            r["generated_match_reference"] = same / max(len(r["generated"]), 1)
    unfuse_routers(model)
    labels = list(results)
    pairwise = {f"{a}|{b}": _compare(logps[a], logps[b]) for i, a in enumerate(labels) for b in labels[i + 1:]}

    report = {
        "metadata": meta,
        "model": str(folder), "text": str(text_path), "scheme": first.scheme.name, "device": str(device),
        "dtype": str(dtype).replace("torch.", ""), "tokens": int(ids.numel()),
        "positions_scored": int(ref.shape[0]), "seq_len": opts.seq_len, "gen_tokens": opts.gen_tokens,
        "experts_modules": len(modules), "experts_bytes": mh.experts_nbytes(model),
        "backends": results, "pairwise": pairwise, "fused_routing": opts.fused_routing, "argv": opts.argv,
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }
    if console is not None:
        table = Table(title=f"moekit eval: {folder.name} ({first.scheme.name}, {report['positions_scored']} positions, {device.type})")
        for col in ("backend", "perplexity", "KL vs reference", "top-1 vs reference", "tokens/s", "greedy = reference"):
            table.add_column(col, justify="left" if col == "backend" else "right")
        for b, r in results.items():
            table.add_row(b, f"{r['perplexity']:.4f}", f"{r['kl_mean_vs_reference']:.2e}",
                          f"{r['top1_agreement_vs_reference']:.1%}",
                          f"{r['tokens_per_s']:.1f}" if "tokens_per_s" in r else "-",
                          f"{r['generated_match_reference']:.0%}" if "generated_match_reference" in r else "-")
        console.print(table)
        if len(labels) > 2:
            pt = Table(title="between backends")
            for col in ("pair", "KL (mean)", "top-1 agreement"):
                pt.add_column(col)
            for k, v in pairwise.items():
                pt.add_row(k.replace("|", " vs "), f"{v['kl_mean']:.2e}", f"{v['top1_agreement']:.1%}")
            console.print(pt)
    if out is not None:
        write_json_atomically(out, report)  # an existing report is replaced whole or not at all
        if console is not None:
            console.print(f"report: {out}")
    return report
