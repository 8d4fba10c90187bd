"""README.md and docs/*.md held to the code (to be folded into test_all.py).

- Every `bash run.sh ...` command printed in README.md or docs/*.md, in a code block or inline,
  is valid. A training command, translated by run.sh's rules (a first FILE.yaml is --config
  FILE.yaml; --nproc, --nproc_per_node, --local_worker_num, --worker_num, --nnodes and the other
  launch flags give the number of workers, several nodes need --master_addr and --node_rank; no
  arguments is the default run), passes `train.main(["check", "--nproc", WORKERS, ...])`.
  `check` runs as it is. `plan` runs for real, and the lines a page prints under
  `$ bash run.sh plan ...` are lines it prints, in a row. The other commands (preprocess,
  generate, convert, import-hf, export-hf, import-megatron) answer `--help`, and the command's
  flags are the ones that help lists, its positional arguments and required flags given; the
  layout and training flags that convert and the imports pass on pass `check` for their --nproc.
  `bench`'s flags and layouts parse; `test` passes its arguments to pytest. The checks run in a
  scratch copy of the project's inputs (configs/, data/; no output/), so a run elsewhere cannot
  make a command look taken; in it:
    * the shipped corpus's tokenized files are empty stand-ins (check looks for them; it does not
      read them), and a `preprocess` command's output files exist for the commands after it on
      its page, as though it had run;
    * a command that sets `device_target=Ascend` (or GPU) is for that device: the device is
      taken as present, the rest is checked;
    * a synopsis, a command with a placeholder word in capitals (DIR, N, FILE.yaml, COMMAND), a
      shell variable, a word opening with `[`, or `...`, is checked by its command's `--help`
      alone (at most three a page).
- Every backticked `module.name` in README.md resolves: the module is one of the project's .py
  files and the attribute chain exists. A span naming a file (`train.py`, `config.yaml`) is a
  file, not an attribute. Every test README or docs name (`test_...`) is one of test_all.py's.
- README.md is a map: at most 300 lines; README and docs lines are under 100 characters, but for
  a program's output quoted under a `$ ` command; their links reach a file and heading that exist.
"""
import glob
import importlib
import os
import re
import shlex

import pytest

import bench
import cli
import train
from keys import FLAGS
from test_all import HERE

DOCS = ["README.md"] + sorted(os.path.relpath(p, HERE)
                              for p in glob.glob(os.path.join(HERE, "docs", "*.md")))
COMMANDS = ("check", "preprocess", "generate", "convert", "import-hf", "export-hf",
            "import-megatron", "plan")
PASSING_ON = ("convert", "import-hf", "import-megatron")     # layout flags go on to the model
LAUNCH = {"--nproc": "per_node", "--nproc_per_node": "per_node", "--local_worker_num": "per_node",
          "--worker_num": "worker_num", "--nnodes": "nnodes", "--node_rank": "node_rank",
          "--master_addr": "master_addr", "--master_port": None, "--log_dir": None}
# run.sh's default run: 4 workers and these flags
DEFAULT_RUN = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--sequence-parallel", "--micro-batch-size", "4", "--global-batch-size", "8",
               "training_config.pipeline_trace=true"]
PLACEHOLDER = re.compile(r"^([A-Z][A-Z_]*(\.yaml)?|\[.*|\$.*|.*\.\.\..*)$")
FILE_SUFFIXES = {"py", "yaml", "yml", "json", "md", "txt", "sh", "pt", "ckpt", "svg", "csv",
                 "log", "bin", "idx"}


# ----------------------------------------------------------------------------- reading the pages
def read(page):
    return open(os.path.join(HERE, page)).read()


def code_blocks_and_prose(text):
    """([(code block lines)], the text outside code blocks)."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return [b.split("\n") for b in blocks], prose


def inline_code(page):
    """The text of each `span` outside code blocks (one may wrap a line, not a paragraph)."""
    prose = code_blocks_and_prose(read(page))[1]
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose) if "\n\n" not in s]


def commands(page):
    """[(argv after `bash run.sh`, the lines printed under it or None)] of a page, in order."""
    found = []
    for lines in code_blocks_and_prose(read(page))[0]:
        joined = re.sub(r"\\\n\s*", " ", "\n".join(lines)).split("\n")
        for i, line in enumerate(joined):
            at = line.find("bash run.sh")
            if at < 0:
                continue
            words = shlex.split(re.split(r"\s(?:&&|\|\||;|\|)\s", line[at:])[0], comments=True)
            output = [l for l in joined[i + 1:] if l] if line.startswith("$ ") else None
            found.append((words[2:], output))
    return found + [(shlex.split(span)[2:], None) for span in inline_code(page)
                    if span.startswith("bash run.sh")]


# ----------------------------------------------------------------------------- checking a command
@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The project's inputs in a scratch folder (see the module docstring), the working folder."""
    os.symlink(os.path.join(HERE, "configs"), tmp_path / "configs")
    os.symlink(os.path.join(HERE, "config.yaml"), tmp_path / "config.yaml")
    (tmp_path / "data").mkdir()
    for entry in os.listdir(os.path.join(HERE, "data")):
        if not entry.endswith((".bin", ".idx")) and entry != "cache":
            os.symlink(os.path.join(HERE, "data", entry), tmp_path / "data" / entry)
    for ext in (".bin", ".idx"):
        (tmp_path / "data" / f"tinyshakespeare_text_document{ext}").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def training_check(words):
    """run.sh's translation of `bash run.sh WORDS` (training) into check's argv."""
    words = list(words)
    if words and words[0].endswith((".yaml", ".yml")) and os.path.isfile(words[0]):
        words.insert(0, "--config")
    launch, args = {}, []
    while words:
        word = words.pop(0)
        flag, eq, value = word.partition("=")
        if flag in LAUNCH:
            value = value if eq else words.pop(0)
            if LAUNCH[flag]:
                launch[LAUNCH[flag]] = value if flag == "--master_addr" else int(value)
        else:
            args.append(word)
    per_node, nnodes = launch.get("per_node"), launch.get("nnodes")
    if "worker_num" in launch:
        per_node = per_node or launch["worker_num"] // (nnodes or 1)
        nnodes = nnodes or launch["worker_num"] // per_node
    if (nnodes or 1) > 1:                  # run.sh: several nodes name node 0 and their own rank
        assert "master_addr" in launch and 0 <= launch.get("node_rank", -1) < nnodes, launch
    if not args and per_node is None:
        per_node, args = 4, list(DEFAULT_RUN)
    return ["check", "--nproc", str((per_node or 1) * (nnodes or 1)), *args]


def help_of(command, capsys):
    """(positional names, required flags, every flag) from `bash run.sh COMMAND --help`."""
    assert train.main([command, "--help"]) == 0, command
    out = capsys.readouterr().out
    usage = out.split("\n")[0].split("[flags]")[0].split()[3:]
    positional = [w for w in usage if w.isupper() and w != "VALUE"]
    required = [w for w in usage if w.startswith("--")]
    return positional, required, re.findall(r"^  (--[\w-]+)", out, re.M)


def check_command(words, output, capsys, monkeypatch):
    """One printed command (the words after `bash run.sh`); returns what it was checked as."""
    if any(PLACEHOLDER.match(w) for w in words):                      # a synopsis
        if words[0] in COMMANDS:
            help_of(words[0], capsys)
        return "synopsis"
    with monkeypatch.context() as patch:
        if any(re.search(r"device_target=(Ascend|GPU)$", w) for w in words):
            patch.setattr(train, "device_available", lambda target: True)
        return check_valid_command(words, output, capsys)


def check_valid_command(words, output, capsys):
    command = words[0] if words else "train"
    if command == "test":
        assert os.path.isfile(os.path.join(HERE, "test_all.py"))
        return "test"
    if command == "bench":
        values, _ = cli.parse_command("bench", words[1:], bench.BENCH_FLAGS)
        assert set(values["layouts"]) <= set(bench.LAYOUTS), values["layouts"]
        return "bench"
    if command not in COMMANDS:
        if "--help" in words or "-h" in words:
            assert train.main(["--help"]) == 0
            return "help"
        assert train.main(training_check(words)) == 0, capsys.readouterr().err
        return "train"
    if command in ("check", "plan") or "--help" in words:
        capsys.readouterr()
        assert train.main(words) == 0, capsys.readouterr().err
        printed = capsys.readouterr().out.split("\n")
        if output:
            starts = [i for i, line in enumerate(printed) if line == output[0]]
            assert any(printed[i:i + len(output)] == output for i in starts), "\n".join(printed)
        return command
    positional, required, flags = help_of(command, capsys)
    rest = words[1:]
    assert len(rest) >= len(positional), (positional, rest)
    assert not any(w.startswith("-") for w in rest[:len(positional)]), (positional, rest)
    rest = rest[len(positional):]
    assert set(required) <= {w.split("=")[0] for w in rest}, (required, rest)
    passed_on, nproc = [], "1"
    while rest:
        word = rest.pop(0)
        flag = word.split("=")[0]
        if flag in flags:
            value = None if "=" in word or not rest or rest[0].startswith("--") else rest.pop(0)
            nproc = value if flag == "--nproc" else nproc
        else:
            assert command in PASSING_ON, f"{command}: {word} is not one of its flags {flags}"
            passed_on.append(word)
    if passed_on:
        assert all(w in FLAGS or "=" in w or not w.startswith("--") for w in passed_on), passed_on
        check = ["check", "--nproc", nproc, "--mock-data", *passed_on]
        assert train.main(check) == 0, capsys.readouterr().err
    return command


def written_outputs(words):
    """The .bin/.idx files a printed preprocess command writes (data.preprocess_main's names)."""
    def values(flag):
        after = words[words.index(flag) + 1:] if flag in words else []
        return after[:next((i for i, w in enumerate(after) if w.startswith("--")), len(after))]
    keys = values("--json-keys") or ["text"]
    if not values("--input")[0].endswith((".json", ".jsonl")):
        keys = ["text"]
    return [f"{values('--output-prefix')[0]}_{key}_document{ext}"
            for key in keys for ext in (".bin", ".idx")]


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("page", DOCS)
def test_every_printed_command_is_valid(page, scratch, capsys, monkeypatch):
    found = commands(page)
    if page == "README.md":
        assert len(found) >= 10, found
    kinds = []
    for words, output in found:
        try:
            kinds.append(check_command(words, output, capsys, monkeypatch))
        except AssertionError as e:
            raise AssertionError(f"{page}: bash run.sh {shlex.join(words)}: {e}") from None
        if words[:1] == ["preprocess"] and "--output-prefix" in words:
            for name in written_outputs(words):
                os.makedirs(os.path.dirname(name) or ".", exist_ok=True)
                open(name, "wb").close()
    assert kinds.count("synopsis") <= 3, (page, kinds)


def test_every_named_module_attribute_exists():
    modules = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(HERE, "*.py"))}
    dotted = re.compile(r"(?<![\w./-])([A-Za-z_]\w*)\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
    names = {f"{module}.{chain}" for span in inline_code("README.md")
             for module, chain in dotted.findall(span)
             if module in modules and chain.rsplit(".", 1)[-1] not in FILE_SUFFIXES}
    assert len(names) >= 30, names
    missing = []
    for name in sorted(names):
        module, *chain = name.split(".")
        obj = importlib.import_module(module)
        for attr in chain:
            obj = getattr(obj, attr, None)
        if obj is None:
            missing.append(name)
    assert not missing, f"README.md names what the code does not hold: {missing}"


def test_every_named_test_exists():
    suite = open(os.path.join(HERE, "test_all.py")).read()
    tests = {name for page in DOCS for span in inline_code(page)
             for name in re.findall(r"\b(test_\w+)(?!\.py)\b", span) if name != "test_all"}
    assert len(tests) >= 20, tests
    missing = sorted(t for t in tests if f"def {t}(" not in suite)
    assert not missing, f"README.md or docs name tests test_all.py does not hold: {missing}"


def anchors(page):
    """The anchors of a page's headings, as GitHub makes them."""
    headings = re.findall(r"^#+ (.*)$", code_blocks_and_prose(read(page))[1], re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_is_a_map_with_short_lines_and_links_that_resolve():
    assert len(read("README.md").split("\n")) <= 300
    long, broken = [], []
    for page in DOCS:
        quoted = False                        # the output under a `$ ` command, as printed
        for number, line in enumerate(read(page).split("\n"), 1):
            quoted = line.startswith("$ ") or (quoted and not line.startswith("```"))
            if len(line) >= 100 and not quoted:
                long.append(f"{page}:{number}")
        links = re.findall(r"\]\(([^)#]*)(?:#([^)]*))?\)", code_blocks_and_prose(read(page))[1])
        for path, anchor in links:
            if path.startswith("http"):
                continue
            target = os.path.relpath(os.path.normpath(os.path.join(HERE, os.path.dirname(page),
                                                                   path or page)), HERE)
            if not os.path.exists(os.path.join(HERE, target)) or (
                    anchor and anchor not in anchors(target)):
                broken.append(f"{page}: {path}#{anchor}")
    assert not long, long
    assert not broken, broken
