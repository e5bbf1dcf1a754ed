"""The `sharddemo` command (click): its options, built from the fields options declares
(declared), one error policy (SafeGroup), and one call per command to its module in
sharddemo.commands, which does the work. Nothing else.

Heavy imports (torch, accelerate) happen inside the commands that need them, so `--help`
and input errors answer at once.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import traceback
from typing import Any, Callable, Optional

import click

from sharddemo.commands.output import error
from sharddemo.errors import DEBUG_ENV, ShardDemoError, UsageError
from sharddemo.options import (DEFAULT_BATCH_SIZE, DEFAULT_DATASET_SIZE, MODES, AuditOptions,
                               ResumeOptions, RunOptions, audit_target, parse_modes)

FORMATS = ("table", "json", "markdown")


def _in_rank() -> bool:
    """True inside a process that a launcher started as one of several ranks."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV) == "1"


class SafeGroup(click.Group):
    """Turns every failure into one `Error:` line and an exit code, in one place:
    2 for usage errors, 1 for failed runs, 130 for Ctrl-C. `--debug` adds the traceback."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        code = 0
        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                              standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except click.exceptions.Exit as exc:
            code = exc.exit_code
        except click.UsageError as exc:
            hint = ""
            if exc.ctx is not None:
                hint = f" (see '{exc.ctx.command_path} --help')"
            error(exc.format_message() + hint)
            code = 2
        except (click.Abort, KeyboardInterrupt) as exc:
            # click turns KeyboardInterrupt into Abort; the signal is on the original.
            signum = getattr(exc, "signum", None) or getattr(exc.__cause__, "signum", signal.SIGINT)
            name = signal.Signals(signum).name
            error(f"interrupted by {name}; all ranks were stopped and no report was written")
            code = 128 + signum
        except ShardDemoError as exc:
            if _in_rank():
                # Every failing rank says so before it exits (commands.ranks).
                from sharddemo.commands.ranks import report_rank_failure

                report_rank_failure(str(exc), exc, usage=isinstance(exc, UsageError))
            else:
                error(str(exc))
            if _debug():
                traceback.print_exc()
            code = exc.exit_code
        except Exception as exc:  # a bug or an unexpected library error: still one line
            message = f"{type(exc).__name__}: {exc}".splitlines()[0]
            if _in_rank():
                from sharddemo.commands.ranks import report_rank_failure

                report_rank_failure(message, exc)
            else:
                error(message + " (run with --debug for the traceback)")
            if _debug():
                traceback.print_exc()
            code = 1
        if standalone_mode:
            if _in_rank():
                _end_rank(code)
            sys.exit(code)
        return code


def _end_rank(code: int) -> None:
    """End a rank process now that its work is done (its trace or its failure written, its
    process group left), without the interpreter's teardown, where a native thread some
    library leaves behind can abort the process (SIGABRT) and have the launcher kill a main
    rank still writing its report (docs/reliability.md, "A rank that aborts as it exits").
    Nothing of ours runs in teardown: the files are closed; the streams are flushed here."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def declared(cls, *names: str) -> Callable[[Callable], Callable]:
    """The click options of the fields `names` of an options dataclass, as sharddemo.options
    declares them (options.option): flag, help, default, type, choices. Nothing is declared
    twice."""
    fields = {f.name: f for f in dataclasses.fields(cls)}

    def decorate(func: Callable) -> Callable:
        for name in reversed(names):
            f = fields[name]
            meta = dict(f.metadata)
            kw: dict[str, Any] = {"help": meta["help"]}
            if "/" in meta["flag"]:
                kw.update(default=f.default, show_default=f.default is not None)
            elif f.default is False:
                kw.update(is_flag=True, default=False)
            else:
                kw["default"] = f.default
                kw["show_default"] = f.default is not None
                if meta.get("choices"):
                    kw["type"] = click.Choice(meta["choices"])
                else:
                    kw["type"] = meta.get("type", type(f.default))
            if meta.get("metavar"):
                kw["metavar"] = meta["metavar"]
            func = click.option(meta["flag"], name, **kw)(func)
        return func

    return decorate


# The options that decide what each rank receives, shared by run and compare.
loader_options = declared(RunOptions, "dataset_size", "batch_size", "epochs", "seed", "shuffle",
                          "drop_last", "set_epoch", "num_workers", "source", "shards",
                          "even_batches", "split_batches", "dispatch_batches", "gather",
                          "timeout", "mesh")


def _options(modes: str, kw: dict[str, Any]) -> RunOptions:
    """`run`'s and `compare`'s options from click's values, each refused alone (validate)."""
    given = {f.name: kw[f.name] for f in dataclasses.fields(RunOptions) if f.name in kw}
    return RunOptions(**given, modes=parse_modes(modes, kw["source"],
                                                 mesh=kw.get("mesh") is not None)).validate()


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """`sharddemo --version` (commands.version), before any command."""
    if not value or ctx.resilient_parsing:
        return
    from sharddemo.commands.version import print_version

    print_version()
    ctx.exit()


@click.group(cls=SafeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=_print_version, help="Show the versions and the distributed type here.")
@click.option("--debug", is_flag=True, help="Show tracebacks and the ranks' full stderr.")
def cli(debug: bool) -> None:
    """See, on real ranks, how torch and accelerate split a dataset across processes.

    Example:

        sharddemo compare
    """
    if debug:
        os.environ[DEBUG_ENV] = "1"


@cli.command()
@click.option("--modes", "--mode", "modes", default="all", show_default=True,
              help="all (prepared, sampler, replicated; over --source webdataset its five "
                   "modes), pitfalls (double-split, unseeded), or a comma list of: "
                   + ", ".join(MODES) + ".")
@loader_options
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True, help="auto: CUDA when available, else CPU with gloo.")
@click.option("--trace-out", type=click.Path(dir_okay=False),
              help="Write the raw trace (every rank's batches, the gathers) as JSON here.")
@click.option("--quiet", is_flag=True, help="Print nothing; use with --trace-out.")
@click.option("--options", "options_file", hidden=True, type=click.Path(dir_okay=False),
              help="The options file a launch of sharddemo compare wrote (its flags then do "
                   "not apply).")
def run(modes: str, device: str, trace_out: Optional[str], quiet: bool,
        options_file: Optional[str], **kw: Any) -> None:
    """The Accelerate script: build each mode's DataLoader, walk it, gather every batch.

    Start it with accelerate so that it runs on several ranks; the main process prints
    each rank's batches (as sample values 1..N) and what accelerator.gather merged.

    Example:

        accelerate launch --config_file accelerate_configs/cpu2.yaml -m sharddemo run --mode all
    """
    from sharddemo.commands.ranks import run_command

    run_command(options_file, lambda: _options(modes, kw), device, trace_out, quiet)


def launch_options(func: Callable) -> Callable:
    """How `compare` and `audit` launch their ranks, with accelerate launch's own names."""
    options = [
        click.option("--config-file", help="accelerate config [default: "
                     "accelerate_configs/cpu2.yaml, or 2gpu.yaml where two or more GPUs are "
                     "visible]."),
        click.option("--num-processes", type=int,
                     help="Override the config's num_processes (all ranks, on every machine)."),
        click.option("--main-process-port", type=int,
                     help="Rendezvous port [default: a free port on this machine; give the "
                          "same one on every machine of a multi-node job]."),
        click.option("--num-machines", type=int,
                     help="Machines in a multi-node job [default: the config's]."),
        click.option("--machine-rank", type=int,
                     help="This machine's rank in a multi-node job; 0 writes the report "
                          "[default: the config's, else 0]."),
        click.option("--main-process-ip", help="Address of machine rank 0 (multi-node)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _settings(kw: dict):
    """How to launch (launch.LaunchSettings) from click's values, taken out of `kw`."""
    from sharddemo.launch import LaunchSettings

    return LaunchSettings(config_file=kw.pop("config_file"), num_processes=kw.pop("num_processes"),
                          main_process_port=kw.pop("main_process_port"),
                          num_machines=kw.pop("num_machines"), machine_rank=kw.pop("machine_rank"),
                          main_process_ip=kw.pop("main_process_ip"))


OUTPUT_HELP = ("Write the whole JSON report here (whole or not at all), before anything is "
               "printed, and print a summary in --format instead of the report: the header, "
               "each mode's conclusion, verdicts and broken promises, and where the file is.")

plot_option = click.option("--plot", type=click.Path(dir_okay=False),
                           help="Also draw the split to this PNG: a panel per mode, a row per "
                                "epoch and rank (needs pip install 'sharddemo[plot]').")


@cli.command()
@launch_options
@click.option("--modes", "--mode", "modes", default="all", show_default=True,
              help="all (prepared, sampler, replicated; over --source webdataset its five "
                   "modes), pitfalls (double-split, unseeded; with --mesh also world-sampler), "
                   "or a comma list of: " + ", ".join(MODES) + ".")
@loader_options
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
              help="How to print the report.")
@click.option("--output", type=click.Path(dir_okay=False), help=OUTPUT_HELP)
@plot_option
@click.option("--check", is_flag=True,
              help="Exit 1 when a mode breaks what it promises (missing samples, unequal steps, "
                   "a replicated rank that did not see everything).")
@click.option("--max-memory", metavar="SIZE", default=None,
              help="Refuse to start when what sharddemo itself would hold on a rank for the ids "
                   "exceeds SIZE (e.g. 512MB, 2GB): the count path's counter, 1 byte per sample "
                   "(3 from 16 ranks on, 5 above 255: the code it reduces; from 2^26 samples 2 "
                   "bits per sample); every id as a "
                   "Python int on rank 0 otherwise (about 40 bytes per sample received, an "
                   "estimate). The loader's own memory is not counted.")
def compare(modes: str, fmt: str, output: Optional[str], plot: Optional[str], check: bool,
            max_memory: Optional[str], **kw: Any) -> int:
    """Run the modes on real ranks in one launch and show side by side what each rank saw.

    For every mode and epoch: each rank's batches (0-based sample ids), step counts,
    coverage (unique, missing, duplicated and why), gather against gather_for_metrics,
    whether the order changed, and a one-line conclusion.

    Example:

        sharddemo compare --dataset-size 10 --batch-size 3 --format markdown
    """
    settings = _settings(kw)
    opts = _options(modes, kw)
    if "resume" in opts.modes:
        _refuse_resume_options()
    from sharddemo.commands.compare import compare_command

    return compare_command(opts, settings, fmt=fmt, output=output, plot=plot, check=check,
                           max_memory=max_memory, debug=_debug())


def _refuse_resume_options() -> None:
    """`--modes resume` runs fixed scenarios: epochs 0..2, 0 and 2 workers, every batch
    gathered (resume.demo_scenarios). Saying so beats ignoring what the user passed."""
    ctx = click.get_current_context()
    given = [f"--{name.replace('_', '-')}" for name in ("epochs", "num_workers", "gather")
             if ctx.get_parameter_source(name) in (click.core.ParameterSource.COMMANDLINE,
                                                  click.core.ParameterSource.ENVIRONMENT)]
    if given:
        verb, them = ("does", "it") if len(given) == 1 else ("do", "them")
        raise UsageError(f"mode resume always walks epochs 0..2 with 0 and 2 workers and "
                         f"gathers every batch, so {' and '.join(given)} {verb} not apply; drop "
                         f"{them}, or audit your own loader: sharddemo audit FILE.py:make_loader "
                         f"--resume-at EPOCH:STEP --epochs N")


def audit_options(func: Callable) -> Callable:
    """The loader audit's own options (what to audit, how to walk it), declared in
    options.AuditOptions."""
    func = declared(AuditOptions, "grad_accum", "epochs", "id_field", "expect", "set_epoch",
                    "dataset_size", "timeout", "gather")(func)
    func = click.option("--lightning", metavar="FACTORY",
                        help="Audit a LightningDataModule's train and val loaders as Lightning's "
                             "Trainer(strategy='ddp') gives them to each rank: make_datamodule() "
                             "-> LightningDataModule (or (datamodule, trainer_kwargs)). Needs the "
                             "[lightning] extra.")(func)
    func = click.option("--trainer", metavar="FACTORY",
                        help="Audit the loaders a transformers Trainer builds: FACTORY is "
                             "file.py:make_trainer or module:make_trainer, make_trainer() -> "
                             "Trainer. Its own get_train_dataloader() and get_eval_dataloader() "
                             "run on every rank; nothing is trained. Needs the [hf] extra.")(func)
    return click.argument("factory", required=False)(func)


def _audit_options(kw: dict) -> AuditOptions:
    """`audit`'s options from click's values (what to audit: exactly one of FACTORY, --trainer
    and --lightning, taken out of `kw`), each refused alone (validate)."""
    target, framework = audit_target(kw.pop("factory"), kw.pop("trainer"), kw.pop("lightning"))
    given = {f.name: kw[f.name] for f in dataclasses.fields(AuditOptions) if f.name in kw}
    return AuditOptions(target=target, framework=framework, **given).validate()


@cli.command()
@audit_options
@launch_options
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
              help="How to print the report.")
@click.option("--output", type=click.Path(dir_okay=False), help=OUTPUT_HELP)
@declared(AuditOptions, "max_time", "keys", "mesh")
@plot_option
@declared(ResumeOptions, "resume_at", "resume_strategy", "resume_num_processes")
@click.option("--keep-checkpoint", type=click.Path(file_okay=False),
              help="Keep the resume checkpoint in this folder [default: a temporary folder, "
                   "removed afterwards].")
def audit(fmt: str, output: Optional[str], plot: Optional[str], resume_at: Optional[str],
          resume_strategy: str, resume_num_processes: Optional[str],
          keep_checkpoint: Optional[str], **kw: Any) -> int:
    """Prove that your own DataLoader shards correctly, on real ranks.

    FACTORY is `package.module:make_loader` or `path/to/file.py:make_loader`, a function
    make_loader(accelerator) -> DataLoader. Every rank calls it with its Accelerator and walks
    the loader as training would. Or, instead of FACTORY, --trainer make_trainer (the loaders
    a transformers Trainer builds) or --lightning make_datamodule (a LightningDataModule's
    loaders under Lightning's DDP sampler injection); their eval loaders get one more
    verdict, eval-counts-each-sample-once. Verdicts per epoch: no missing samples, no duplicates beyond
    the loader's own padding, equal step counts, a new order each epoch, no silent
    replication; with --resume-at, also resume-exact (the run stopped, restarted in fresh
    processes and resumed sees exactly what an uninterrupted run sees). Exit 0 when all
    hold, 1 when one fails, 2 for bad input.

    Example:

        sharddemo audit examples/good.py:make_loader --num-processes 3

        sharddemo audit examples/resume_exact.py:make_loader --resume-at 0:3

        sharddemo audit --trainer examples/trainer_example.py:make_trainer
    """
    settings = _settings(kw)
    opts = _audit_options(kw)
    from sharddemo.commands.audit import audit_command

    return audit_command(opts, settings,
                         ResumeOptions(resume_at, resume_strategy, resume_num_processes),
                         fmt=fmt, output=output, plot=plot, keep_checkpoint=keep_checkpoint,
                         debug=_debug())


# The rank commands: `compare` and `audit` start them through accelerate launch and hand them
# their options as one JSON file (options.write_rank_options), so nothing is parsed twice.
rank_command_options = [
    click.option("--options", "options_file", required=True, type=click.Path(dir_okay=False),
                 help="The options file the launch wrote."),
    click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto"),
    click.option("--trace-out", type=click.Path(dir_okay=False)),
    click.option("--quiet", is_flag=True),
]


def rank_command(name: str) -> Callable[[Callable], Callable]:
    def decorate(func: Callable) -> Callable:
        for option in reversed(rank_command_options):
            func = option(func)
        return cli.command(name, hidden=True)(func)

    return decorate


@rank_command("resume-demo-rank")
def resume_demo_rank(options_file: str, device: str, trace_out: Optional[str],
                     quiet: bool) -> None:
    """The rank side of `sharddemo compare --modes resume`, started through accelerate launch
    with the options file its parent wrote (phase, checkpoint, the run's options)."""
    from sharddemo.commands.ranks import resume_demo_rank_command

    resume_demo_rank_command(options_file, device, trace_out)


@rank_command("resume-rank")
def resume_rank(options_file: str, device: str, trace_out: Optional[str],
                quiet: bool) -> None:
    """The rank side of `sharddemo audit --resume-at` (one launch of the chain: from the start
    to the first stop, or from a saved stop to the next stop or the end), started through
    accelerate launch with its options file."""
    from sharddemo.commands.ranks import resume_rank_command

    resume_rank_command(options_file, device, trace_out)


@rank_command("audit-rank")
def audit_rank(options_file: str, device: str, trace_out: Optional[str],
               quiet: bool) -> None:
    """The rank side of `audit` (started by `sharddemo audit` through accelerate launch with
    its options file)."""
    from sharddemo.commands.ranks import audit_rank_command

    audit_rank_command(options_file, device, trace_out)


@cli.command()
@click.option("--num-processes", type=int, default=2, show_default=True,
              help="How many processes to ask accelerate for.")
@click.option("--dataset-size", type=int, default=DEFAULT_DATASET_SIZE, show_default=True,
              help="Number of samples N.")
@click.option("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, show_default=True,
              help="Per-rank batch size B.")
def trap(num_processes: int, dataset_size: int, batch_size: int) -> None:
    """Show the silent replication trap: `accelerate launch --cpu --num_processes 2`.

    On CPU that command starts ONE process, which runs, prints, and sees the whole dataset.
    This runs it for real (with sharddemo's own guard turned off), shows what you would see,
    how to recognise it, and the fix.

    Example:

        sharddemo trap --num-processes 2
    """
    from sharddemo.commands.trap import trap_command

    trap_command(num_processes, dataset_size, batch_size)


@cli.command()
@click.option("--path", "name", metavar="NAME",
              help="Print the installed file's path of config NAME, for "
                   "`accelerate launch --config_file`.")
def configs(name: Optional[str]) -> None:
    """List the accelerate configs that ship with sharddemo, or print one's path.

    They are installed inside the package, so they are found wherever pip put it; the
    repository's accelerate_configs/ holds the same files.

    Example:

        accelerate launch --config_file "$(sharddemo configs --path cpu2.yaml)" -m sharddemo run
    """
    from sharddemo.commands.configs import configs_command

    configs_command(name)


@cli.command()
@click.argument("report", metavar="REPORT.jsonl")
def check(report: str) -> int:
    """Gate CI on a watch report: print its failed entries; exit 1 if any failed.

    REPORT.jsonl is the file sharddemo.watch appended to (docs/watch.md). Exit 0 when every
    entry held, 1 when any failed (each printed in one line), 2 with one Error: line for a
    file that is not a watch report. A last line cut short by a crash is skipped with a
    warning.

    Example:

        sharddemo check runs/sharddemo-watch.jsonl
    """
    from sharddemo.commands.check import check_command

    return check_command(report)


@cli.command()
@click.argument("folder", metavar="DIR")
@click.option("--step", type=int, help="The step (counted from 0 per rank, across epochs and "
              "resumes; with --epoch: the epoch's K-th batch) whose samples to print.")
@click.option("--rank", type=int, help="Only this rank [default: every rank].")
@click.option("--epoch", type=int, help="Count --step from the first batch of this epoch.")
@click.option("--id", "sample", type=int, help="Print every (epoch, step, rank) at which the "
              "written lineage holds this sample.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table",
              show_default=True)
def lineage(folder: str, step: Optional[int], rank: Optional[int], epoch: Optional[int],
            sample: Optional[int], fmt: str) -> None:
    """Which samples each rank received at a step, or where a sample was received.

    DIR is the folder a watched run wrote with watch(..., lineage=DIR) (docs/watch.md, "The
    batch behind a step"). Give --step K, or --id ID. It says what is written: after a crash a
    rank's lineage may end before the steps it trained (the last unwritten chunk), and a rank
    whose written lineage has no step K is named with where its lineage ends ("written up to
    step J"). Exit 2, with one Error: line, where no rank's written lineage has step K, and
    for an id outside the dataset (0..N-1). A last chunk cut short by a crash is skipped
    with a warning.

    Example:

    \b
        sharddemo lineage runs/lineage --step 48112
        sharddemo lineage runs/lineage --id 1234 --format json
    """
    from sharddemo.commands.lineage import lineage_command

    lineage_command(folder, step, rank, epoch, sample, fmt)


def main() -> None:
    from sharddemo.options import PARENT_ENV

    parent = os.environ.pop(PARENT_ENV, None)
    if parent and parent.isdigit():
        # A rank of a launch of `compare` / `audit`: it ends with that launch, however its
        # parent dies; asked first, before the seconds of torch's import.
        from sharddemo.lifeline import end_with_launch

        end_with_launch(int(parent))
    cli()


if __name__ == "__main__":
    main()
