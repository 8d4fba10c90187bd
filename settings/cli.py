"""The command line and the YAML files, read through the one key table (keys.py): Megatron-LM's
flags, dotted `section.key=value` overrides and the guides' spellings of every key in a YAML,
each resolved to its canonical key (`load_config`); and one mechanism for every other command's
flags with --help (`parse_command`).

Every bad flag, key or value raises ConfigError with one line naming it and the fix. What a
guide's spelling became, and what an inert key does not do, is collected in `notes`, which
training logs once at start.
"""
import ctypes
import functools
import os
import random
import secrets
import signal
import socket
import sys

import yaml

from settings.config import SHM_TOKEN, ConfigError, finalize, merge, suggest, to_namespace
from settings.keys import ALIASES, FLAGS, KEYS, SCHEMA, SECTIONS, VALUE

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))    # the project's folder
PROJECT_CONFIG = os.path.join(PROJECT, "config.yaml")


def _set(tree, dotted, value, element=None):
    """tree[a][b][c] = value for dotted "a.b.c" (element: an index into the list there)."""
    *parents, leaf = dotted.split(".")
    node = tree
    for name in parents:
        node = node.setdefault(name, {})
    if element is None:
        node[leaf] = value
    else:
        default = list(KEYS[dotted].default)
        node[leaf] = list(node.get(leaf) or default)
        node[leaf][element] = value


def _row(path, where=None):
    """The row of a key as the guides spell it, with the translation of its value; `where` (a
    file) prefixes the error of an unknown one."""
    if path in KEYS:
        return KEYS[path], None
    if path in ALIASES:
        return ALIASES[path]
    known = list(KEYS) + list(ALIASES)
    sections, section = {k.split(".")[0] for k in known}, path.split(".")[0]
    problem = (f"unknown section {section}{suggest(section, sections)}" if section not in sections
               else f"unknown key {path}{suggest(path, known)}")
    raise ConfigError(f"{where}: {problem}" if where else problem)


def resolve(path, value, where, notes):
    """(canonical path, value) of `path`=`value` given in `where` (a file, the command line), or
    None for an inert key, whose warning goes to `notes` as does each translated spelling."""
    row, translate = _row(path, where if where != "command line" else None)
    if row.kind == "inert":
        shown = path if path == row.path else f"{path} ({row.path})"
        notes.append(f"warning: {where}: {shown}={value} has no effect here: {row.help}")
        return None
    if translate:
        value = translate(value)
    if isinstance(value, str) and row.values:
        value = row.values.get(value, value)
    if path != row.path:
        notes.append(f"{where}: {path} is {row.path}={value}")
    return row.path, value


def _is_prefix(path):
    return any(known.startswith(path + ".") for known in list(KEYS) + list(ALIASES))


def _leaves(tree, where, prefix=""):
    """(dotted path, value) of every key in the YAML tree of file `where`; a mapping that is not
    a key is a section."""
    for name, value in tree.items():
        path = f"{prefix}{name}"
        section = path not in KEYS and path not in ALIASES and _is_prefix(path)
        if isinstance(value, dict) and path not in KEYS and path not in ALIASES:
            yield from _leaves(value, where, path + ".")
        elif section and value is not None:
            raise ConfigError(f"{where}: section {path} must be a mapping of keys, "
                              f"got {value!r:.40}")
        elif not section:
            yield path, value


def canonical_tree(raw, where, notes):
    """The YAML tree `raw`, every key at its canonical path; two spellings of one key that
    disagree are refused."""
    tree, given = {}, {}
    for path, value in _leaves(raw, where):
        resolved = resolve(path, value, where, notes)
        if resolved is None:
            continue
        target, value = resolved
        if target in given and given[target][1] != value:
            raise ConfigError(f"{where}: {given[target][0]}={given[target][1]} and {path}={value} "
                              f"both set {target}: give one")
        given[target] = (path, value)
        _set(tree, target, value)
    return tree


def _flag_value(flag, inline, args, i):
    """The value text of a flag given as `--flag=text` or `--flag text`, and the next index."""
    if inline is not None:
        return inline, i
    if i >= len(args):
        raise ConfigError(f"flag {flag} needs a value")
    return args[i], i + 1


def _typed(row, text):
    """A command-line text as the key's type: strings as given (a path stays a path), the rest
    as YAML reads them (numbers, true/false, lists); a path or a list of them (a blend) stays
    text unless written as a YAML list."""
    if row.type is str or (row.type == (str, list) and not text.startswith("[")):
        return text
    return yaml.safe_load(text) if text != "" else ""


def _apply_flag(flag, inline, args, i, raw, notes):
    """Set what one Megatron flag sets; returns the index after its values."""
    if flag not in FLAGS:
        raise ConfigError(f"unknown flag {flag}{suggest(flag, FLAGS)}")
    targets = FLAGS[flag]
    if targets[0][1] is not VALUE:                      # a switch: sets fixed values
        for row, value, _ in targets:
            resolved = resolve(row.path, value, flag, notes)
            if resolved:
                _set(raw, *resolved)
        return i
    (row, _, element), = targets
    text, i = _flag_value(flag, inline, args, i)
    value = _typed(row, text)
    if row.type == (str, list) and inline is None:
        words = [value]                                  # Megatron's nargs='*': 0.3 web 0.7 books
        while i < len(args) and not args[i].startswith("--") and "=" not in args[i]:
            words.append(args[i])
            i += 1
        value = words if len(words) > 1 else value
    elif row.type is list and element is None and not isinstance(value, list):
        value = [value]                                  # Megatron: --profile-ranks 0 1 ...
        while i < len(args) and args[i].isdigit():
            value.append(int(args[i]))
            i += 1
    resolved = resolve(row.path, value, f"{flag} {text}", notes)
    if resolved:
        _set(raw, *resolved, element)
    return i


def parse_overrides(args, raw, notes):
    """Apply Megatron flags (`--hidden-size 128`, `--fp16`) and dotted overrides
    (`model_config.hidden_size=128`, any spelling a guide uses) to the tree `raw`, in order."""
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg.startswith("--"):
            flag, eq, inline = arg.partition("=")
            i = _apply_flag(flag, inline if eq else None, args, i, raw, notes)
        elif "=" in arg:
            path, _, text = arg.partition("=")
            resolved = resolve(path, _typed(_row(path)[0], text), "command line", notes)
            if resolved:
                _set(raw, *resolved)
        else:
            raise ConfigError(f"unexpected argument {arg!r}: use --megatron-flag VALUE or "
                              "section.key=VALUE")
    return raw


def _override_warmup(before, raw):
    """Warmup is given in iterations or as a fraction: a later layer's choice replaces an earlier
    one's (`before` is the schedule as it was)."""
    schedule = _schedule(raw)
    for chosen, other, cleared in (("lr_warmup_iters", "lr_warmup_fraction", None),
                                   ("lr_warmup_fraction", "lr_warmup_iters", 0)):
        changed = schedule.get(chosen) != before.get(chosen)
        if changed and schedule.get(other) == before.get(other) and other in schedule:
            schedule[other] = cleared


def _schedule(raw):
    return (raw.get("optimizer_config") or {}).get("learning_rate_scheduler_kwargs") or {}


def _known(values, schema):
    """The keys of a saved config tree that the schema has (derived values dropped)."""
    return {k: _known(v, schema[k]) if isinstance(schema[k], dict) else v
            for k, v in (values or {}).items() if k in schema}


def from_saved(saved, args=(), world_size=1):
    """The config a checkpoint stored (to_dict), in a new layout: the parallel sizes, recompute,
    the distributed optimizer and the micro-batch count back to their defaults, then `args`
    applied, derived and validated."""
    raw = {section: _known(saved.get(section), schema) for section, schema in SCHEMA.items()}
    raw["parallel_config"] = {}
    for key in ("recompute_granularity", "recompute_method", "recompute_num_layers"):
        # the run's choice for its layout, not the model's
        raw["model_config"].pop(key, None)
    raw["training_config"].pop("use_distributed_optimizer", None)
    raw["dataset_config"].pop("micro_batch_num", None)  # derived from the global batch and DP
    if not raw["model_config"].get("group_query_attention"):
        raw["model_config"].pop("num_query_groups", None)       # derived: one group per head
    if _schedule(raw).get("lr_warmup_fraction") is not None:   # a saved config may hold both:
        _schedule(raw).pop("lr_warmup_iters", None)            # the fraction is what ran
    tree = {s: merge(SCHEMA[s], raw.get(s), s) for s in SCHEMA}
    raw = parse_overrides(list(args), tree, [])
    cfg = to_namespace({s: merge(SCHEMA[s], raw.get(s), s) for s in SCHEMA})
    finalize(cfg, world_size)
    return cfg


# ----------------------------------------------------------------------------- command lines
REQUIRED = object()


class HelpRequested(Exception):
    """--help or -h: the message is the command's usage; the caller prints it and exits 0."""


def answered(main):
    """A command's main(argv) -> exit code, answering --help and a refused command line as every
    command does: HelpRequested, its usage printed, 0; ConfigError, one `error:` line, 2."""
    @functools.wraps(main)
    def command(argv):
        try:
            return main(argv)
        except HelpRequested as e:
            print(e)
            return 0
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return command


def _usage(command, flags, positional, passthrough, about):
    """A command's --help: the usage line, what the command does, then one line per flag."""
    required = [f"{f} VALUE" for f, spec in flags.items() if spec[0] is REQUIRED]
    words = [command, *positional] + required
    usage = f"usage: bash run.sh {' '.join(words)} [flags]"
    lines = [usage + (f" [{passthrough}]" if passthrough else "")]
    lines += [about] if about else []
    for flag, (default, typ, text) in flags.items():
        shown = "required" if default is REQUIRED else f"default {default!r}"
        lines.append(f"  {flag:22s} {text} ({shown})")
    return "\n".join(lines)


# --config, as every command that reads a training config takes it (training, check, plan)
CONFIG_FLAG = ([], list, "YAML files, each layered over config.yaml and the ones before it "
                         "(repeat the flag or list several; presets in configs/)")


def parse_command(command, argv, flags, positional=(), passthrough=None, about=""):
    """Every command's flags through one mechanism. flags: {"--name": (default, type, help)}, the
    default REQUIRED for a flag that must be given, type bool for a switch, list for one or more
    values; positional: names of leading arguments. Returns ({name: value} with "--load" ->
    "load", the arguments left for `passthrough`), refusing an unknown flag with a suggestion
    unless `passthrough` (a text naming what takes them, e.g. "training flags") is given."""
    if "--help" in argv or "-h" in argv:
        raise HelpRequested(_usage(command, flags, positional, passthrough, about))
    argv, values, rest = list(argv), {}, []
    for name in positional:
        if not argv or argv[0].startswith("-"):
            raise ConfigError(f"{command} needs {name} first (bash run.sh {command} --help)")
        values[name.lower()] = argv.pop(0)
    while argv:
        arg = argv.pop(0)
        flag, eq, inline = arg.partition("=")
        if flag not in flags:
            if passthrough:
                rest.append(arg)
                continue
            raise ConfigError(f"{command}: unknown argument {arg!r}{suggest(flag, flags)} "
                              f"(bash run.sh {command} --help)")
        typ = flags[flag][1]
        if typ is bool:
            values[flag[2:].replace("-", "_")] = True
            continue
        if typ is list:                                # nargs='+'; a repeated flag adds to it
            items = [inline] if eq else []
            while not eq and argv and not argv[0].startswith("--") and "=" not in argv[0]:
                items.append(argv.pop(0))
            value = values.get(flag[2:].replace("-", "_"), []) + items
        else:
            if not eq and not argv:
                raise ConfigError(f"{command}: {flag} needs a value")
            text = inline if eq else argv.pop(0)
            try:
                value = typ(text)
            except ValueError:
                raise ConfigError(f"{command}: {flag} expects {typ.__name__}, "
                                  f"got {text!r}") from None
        values[flag[2:].replace("-", "_")] = value
    for flag, (default, typ, _) in flags.items():
        key = flag[2:].replace("-", "_")
        if key not in values:
            if default is REQUIRED:
                raise ConfigError(f"{command} needs {flag} (bash run.sh {command} --help)")
            values[key] = False if typ is bool and default is None else default
    return values, rest


def parse_layouts_command(command, argv, flags, layouts, about):
    """parse_command for a command whose --layouts names keys of `layouts`: (options, None), or
    (None, the exit code) once its help or one error line is printed."""
    try:
        options, _ = parse_command(command, argv, flags, about=about)
        unknown = [name for name in options["layouts"] if name not in layouts]
        if unknown:
            raise ConfigError(f"{command}: unknown layout {unknown[0]!r}: choose from "
                              f"{', '.join(layouts)}")
    except HelpRequested as e:
        print(e)
        return None, 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None, 2
    return options, None


def _flag_rows():
    """(flag, what it sets, default, meaning) for every flag of the key table."""
    for flag, targets in FLAGS.items():
        row, value, element = targets[0]
        if value is VALUE:
            shown = row.path + (f".{element}" if element is not None else "")
            default = row.default if element is None else row.default[element]
            yield flag, shown, "null" if default is None else default, row.help
        else:
            sets = ", ".join(f"{r.path}={v}" for r, v, _ in targets)
            yield flag, sets, "switch", row.help


def scheduler_port():
    """A random free port for msrun's scheduler on this machine, from run.sh's range: MindSpore's
    workers listen from 8118 up (256 ports a rank, servers above them to 16309), and a scheduler
    that finds its port taken leaves its workers waiting for --cluster_time_out (run.sh). Drawn
    from the system's entropy: MindSpore's set_seed seeds Python's `random` too, and launches
    started beside each other after a training had drawn the same port (seen: 27220, every
    time, in the suite)."""
    while True:
        port = random.SystemRandom().randint(20000, 28999)
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) != 0:             # no process accepts there
                return port


PR_SET_PDEATHSIG = 1        # linux/prctl.h


def end_with_parent():
    """Under run.sh (RUN_SH_PARENT: run.sh's pid, msrun's for msrun's workers and scheduler):
    SIGTERM to this process when that parent ends, however it ends (kill -9 included), rather
    than a process left running without it (Linux's PR_SET_PDEATHSIG). A parent that ended
    before the call (this process is another's child by then) is the check after it."""
    parent = os.environ.get("RUN_SH_PARENT")
    if parent:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != int(parent):
            os.kill(os.getpid(), signal.SIGTERM)


def msrun_command(workers, log_dir, program):
    """(argv, environment) of an msrun launch of `workers` workers on this machine that run
    `program` ([script, its arguments]) with this interpreter: msrun starts `python` from PATH,
    so this interpreter's folder leads PATH; worker_<rank>.log of each goes to log_dir.
    MS_NODE_TIMEOUT is also how long a CPU collective waits for its peers (MindSpore's
    CollectiveOpsImpl reads it): run.sh's 10 s, which ends a job soon after a worker dies, is
    too short for these launches of many runs, where a peer can spend longer compiling its
    first step on an oversubscribed machine (seen: TP2 x PP2 in float16 with 4 workers).
    --cluster_time_out is how long init() waits for the last worker to start. Each launch gets
    a secret of its own, SHM_TOKEN, which names its shared-memory segments (backends/)."""
    bin_dir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"],
               GLOG_v=os.environ.get("GLOG_v", "3"), MS_NODE_TIMEOUT="90")
    env[SHM_TOKEN] = secrets.token_hex(16)
    cmd = [os.path.join(bin_dir, "msrun"), "--worker_num", str(workers), "--local_worker_num",
           str(workers), "--master_port", str(scheduler_port()), "--join", "True",
           "--cluster_time_out", "120", "--log_dir", log_dir, *program]
    return cmd, env


def training_help():
    """`bash run.sh --help`: the commands, then every Megatron flag with its key, default and
    meaning, from the key table (keys.py)."""
    lines = ["usage: bash run.sh [--nproc N] [--config FILE ...] [FILE.yaml] [Megatron flags] "
             "[section.key=VALUE ...]   train",
             "       bash run.sh COMMAND [flags]   COMMAND: test, tour, bench, check, preprocess, "
             "generate, convert,",
             "                                     import-hf, export-hf, import-megatron, plan, "
             "parity,",
             "                                     exercise (bash run.sh COMMAND --help)",
             "Each --config FILE is layered over the project's config.yaml and the files before "
             "it; the defaults",
             "below are the key table's (keys.py), which config.yaml overrides; every key can "
             "also be set as",
             "section.key=VALUE, in any spelling the guides use (configs/guides/).",
             f"  {'flag':40s} {'key':58s} {'default':10s} meaning"]
    for flag, key, default, meaning in _flag_rows():
        lines.append(f"  {flag:40s} {key:58s} {str(default):10s} {meaning}")
    return "\n".join(lines)


def read_yaml(path, notes):
    """The keys of the YAML file at `path` at their canonical paths (canonical_tree), or one line
    naming the file and what is wrong."""
    if not os.path.isfile(path):
        problem = "is a directory" if os.path.isdir(path) else "not found"
        raise ConfigError(f"config file {path} {problem}: pass --config FILE (a YAML file) or run "
                          "from the project folder")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of the sections {', '.join(SECTIONS)}, "
                          f"got {raw!r:.40}")
    return canonical_tree(raw, path, notes)


def _leaf_values(tree, prefix=""):
    for name, value in tree.items():
        if isinstance(value, dict):
            yield from _leaf_values(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def _layer(base, over):
    """`base` with `over`'s keys replacing its own, sub-section by sub-section (lists whole)."""
    out = dict(base)
    for name, value in over.items():
        nested = isinstance(base.get(name), dict) and isinstance(value, dict)
        out[name] = _layer(base[name], value) if nested else value
    return out


def layered(paths, notes, under=None):
    """config.yaml, then `under` (a tree, e.g. a checkpoint's model keys), then each YAML file in
    `paths` over the ones before (its keys replace theirs). A value a later file replaces of an
    earlier file's is named in `notes`."""
    raw, origin = _layer(read_yaml(PROJECT_CONFIG, []), under or {}), {}
    for path in paths:
        tree, before = read_yaml(path, notes), dict(_schedule(raw))
        values = dict(_leaf_values(raw))
        for key, value in _leaf_values(tree):
            if key in origin and values[key] != value:
                notes.append(f"{path}: {key}={value} replaces {values[key]} from {origin[key]}")
            origin[key] = path
        raw = _layer(raw, tree)
        _override_warmup(before, raw)
    return raw


def load_config(paths=(), args=(), world_size=1, notes=None, under=None):
    """The run's config: config.yaml with the YAML files `paths` (one path or a list) layered
    over it (layered), then the command line `args`, derived values filled and validated.
    Returns a namespace per section (cfg.model_config.hidden_size, ...); translations of the
    guides' spellings and inert keys' warnings are appended to `notes` if given."""
    raw = raw_config(paths, args, [] if notes is None else notes, under)
    cfg = to_namespace({s: merge(SCHEMA[s], raw.get(s), s) for s in SCHEMA})
    finalize(cfg, world_size)
    return cfg


def raw_config(paths, args, notes, under=None):
    """The layered files and the command line as one tree of canonical keys, not yet checked."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    paths = [p for p in paths if os.path.abspath(p) != PROJECT_CONFIG]
    raw = layered(paths, notes, under)
    before = dict(_schedule(raw))
    raw = parse_overrides(list(args), raw, notes)
    _override_warmup(before, raw)
    return raw


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: cli.py is a library: run `bash run.sh` (bash run.sh --help "
                     "lists the commands)")
