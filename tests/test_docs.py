"""The documentation runs and cannot drift: every Python block of README.md and docs/*.md
runs as printed (a fresh interpreter each, from the repository root), every command of their
bash blocks (and of benchmarks/README.md's and experiments/README.md's) runs or is read by its
own parser, and every knob table is the one tools/knobs.py generates from the config
dataclasses' declarations."""

import contextlib
import dataclasses
import importlib
import importlib.util
import io
import re
import shlex
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from diloco_eqx.config import DiLoCoConfig
from diloco_eqx.training.cli import field_docs
from tests.helpers import subprocess_env
from tools import knobs

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^([ \t]*)```(\S*)[^\n]*\n(.*?)^\1```", re.S | re.M)


def _blocks(path: Path) -> list[tuple[str, str]]:
    """(language, code) of each fenced block of a page, dedented."""
    return [(m[2], textwrap.dedent(m[3])) for m in FENCE.finditer(path.read_text())]


BLOCKS = [(path, i, code) for path in PAGES
          for i, code in enumerate(code for lang, code in _blocks(path) if lang == "python")]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_readme_and_docs_have_python_blocks():
    names = {_name(path) for path, _, _ in BLOCKS}
    assert {"README.md", "docs/tutorial.md"} <= names


def test_no_python_block_hides_under_another_name():
    """A block tagged `py`, `python3` or `pycon` would not be run: Python is tagged `python`."""
    for path in PAGES:
        tags = {lang for lang, _ in _blocks(path)}
        assert not tags & {"py", "python3", "pycon", "ipython", "Python"}, _name(path)


@pytest.mark.parametrize("path,index,code", BLOCKS, ids=[f"{_name(p)}-{i}" for p, i, _ in BLOCKS])
def test_python_block_runs(path, index, code):
    env = subprocess_env(PYTHONPATH=str(ROOT))  # a block that makes a mesh asks for its own devices
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{_name(path)} block {index}:\n{code}\n{proc.stderr[-3000:]}"


def test_readme_knob_tables_are_the_generated_ones():
    text = (ROOT / "README.md").read_text()
    assert knobs.BLOCK.search(text), "README.md has no generated knob table"
    assert knobs.fill(text) == text, "README.md's knob table is stale: python -m tools.knobs --write"


def test_every_docs_marker_expands():
    for path in sorted((ROOT / "docs").glob("*.md")):
        expanded = knobs.expand(path.read_text())
        assert "<!-- knobs" not in expanded, _name(path)
    config_page = (ROOT / "docs" / "configuration.md").read_text()
    assert "<!-- knobs: diloco_eqx.config.DiLoCoConfig -->" in config_page


def test_table_rows_are_the_declarations():
    """One row per field, in declaration order: name, flag, declared type, default (and the
    training command's default where it differs), the field's docstring."""
    lines = knobs.table("diloco_eqx.config.DiLoCoConfig").splitlines()
    fields = dataclasses.fields(DiLoCoConfig)
    assert len(lines) == 2 + len(fields)
    assert [line.split(" | ")[0] for line in lines[2:]] == [f"| `{f.name}`" for f in fields]
    row = dict(zip(["field", "flag", "type", "default", "run", "meaning"],
                   lines[2 + [f.name for f in fields].index("sync_period")].strip("| ").split(" | ")))
    assert row == {"field": "`sync_period`", "flag": "`--sync-period`", "type": "`int`", "default": "`100`",
                   "run": "`30`", "meaning": field_docs(DiLoCoConfig)["sync_period"]}
    streaming = lines[2 + [f.name for f in fields].index("streaming")]
    assert "`--[no-]streaming`" in streaming and "`False` | `True`" in streaming


def test_a_table_picks_fields_across_sections_and_escapes_pipes():
    table = knobs.table("diloco_eqx.training.config.RunConfig steps diloco.fragment_order data.corpus")
    rows = table.splitlines()[2:]
    assert [r.split(" | ")[0] for r in rows] == ["| `steps`", "| `diloco.fragment_order`", "| `data.corpus`"]
    assert "<code>str &#124; Order</code>" in rows[1]  # a pipe in a code span would split GitHub's cells
    assert r"\| markov" in rows[2] and "`('stdlib',)`" in rows[2]
    with pytest.raises(ValueError, match="no field 'nope'"):
        knobs.table("diloco_eqx.training.config.RunConfig nope")
    with pytest.raises(ValueError, match="names no config dataclass"):
        knobs.table("diloco_eqx.config.Nothing")


def test_write_regenerates_a_stale_table_and_check_reports_it(tmp_path):
    page = tmp_path / "page.md"
    spec = "diloco_eqx.training.config.OptimizerConfig"
    page.write_text(f"intro\n<!-- knobs:begin {spec} -->\n| old | table |\n<!-- knobs:end -->\nafter\n")
    assert knobs.main(["--check", str(page)]) == 1
    assert knobs.main(["--write", str(page)]) == 0
    assert page.read_text() == f"intro\n<!-- knobs:begin {spec} -->\n{knobs.table(spec)}\n<!-- knobs:end -->\nafter\n"
    assert knobs.main(["--check", str(page)]) == 0


# ---------------------------------------------------------------- the shell blocks

SHELL_PAGES = [*PAGES, ROOT / "benchmarks" / "README.md", ROOT / "experiments" / "README.md"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

SKIP = {(".", ".venv/bin/activate"): "activates the environment the command before it made"}
"""Shell-only commands (the whole command, word for word): nothing of the project's to check."""

PLACEHOLDERS = {"RANK": "0"}
"""Shell variables a page leaves to the reader's launcher, and the value checked in their
place: `$RANK` is each host's `--process-id`."""

USER_FILES = {"my_strategies.py": '''
def deepest_first(num_layers, num_fragments):
    """Fragment 1 the deepest layers, the last fragment the shallowest."""
    per = num_layers // (num_fragments - 1)
    return tuple(tuple(range(num_layers - (i + 1) * per, num_layers - i * per)) for i in range(num_fragments - 1))
'''}
"""Modules a page's commands import that the reader writes (the page says "your own module")."""

CHEAP = {"tools.knobs", "tools.schedule_table"}
"""Modules whose commands take seconds: they run as printed, as does any `--help`."""

EXTERNAL = {"pytest": "the test suite: this test is part of it"}
"""Other projects' modules a page runs: checked to be installed."""

TRAINING = {"experiments.train", "diloco_eqx.training.cli"}
"""The training command's modules: their command lines are checked by the training parser,
`--model` and `--config` included."""

LAUNCHER = """import runpy, sys
from diloco_eqx.training import cli

def main(argv=None, prog=cli.PROG):  # the training command, up to its command line being read
    cli.parse_run_config(argv, cli.build_parser(prog, cli.DESCRIPTION))
    return 0

cli.main = main
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
"""Runs a script a page writes, which hands over to the training command (`cli.main()`), with
that command reading its flags and stopping there."""

SEPARATORS = {";", "&", "&&", "|", "||"}
REDIRECTS = {">", ">>", "<<"}


@dataclasses.dataclass
class Command:
    argv: list[str]
    line: str
    writes: str | None = None  # `> FILE`
    heredoc: str | None = None  # the text of `<<TAG ... TAG`
    kind: str = ""  # what the check did: run, parsed, installed, shell, skipped


def _words(line: str) -> list[str]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
    lex.whitespace_split = True  # words split at blanks and at the operators only; `#` starts a comment
    return list(lex)


def _expand(word: str, variables: dict[str, str]) -> list[str]:
    """A word with `$NAME` or `${NAME}` replaced: the block's own variable (split into words, as
    unquoted), else the named placeholder; any other `$` is refused."""
    m = re.fullmatch(r"\$(?:(\w+)|\{(\w+)\})", word)
    if m is None:
        if "$" in word:
            raise ValueError(f"a word with a variable inside it: {word!r}")
        return [word]
    name = m[1] or m[2]
    if name in variables:
        return shlex.split(variables[name])
    if name in PLACEHOLDERS:
        return [PLACEHOLDERS[name]]
    raise ValueError(f"${name} is neither set in the block nor a placeholder of PLACEHOLDERS")


def _bash_commands(code: str) -> list[Command]:
    """The commands of a bash block: `\\` continuations joined, comments stripped, lines split at
    `&&`, `||`, `;`, `&` and `|`; a here-document's text kept with its command; `NAME=VALUE`
    alone sets a variable of the block, and `$NAME` expands to it."""
    lines, commands, variables = code.splitlines(), [], {}
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        while line.endswith("\\") and i < len(lines):
            line = line[:-1] + " " + lines[i]
            i += 1
        parts: list[list[str]] = [[]]
        for w in _words(line):
            if w in SEPARATORS:
                if not parts[-1]:
                    raise ValueError(f"an empty command before {w!r}: {line!r}")
                parts.append([])
            elif set(w) <= set(";&|<>") and w not in REDIRECTS:
                raise ValueError(f"an operator this check does not know, {w!r}: {line!r}")
            else:
                parts[-1].append(w)
        for part in filter(None, parts):
            cmd, words, k = Command([], line.strip()), [], 0
            while k < len(part):
                if part[k] not in REDIRECTS:
                    words.append(part[k])
                    k += 1
                    continue
                if k + 1 == len(part) or part[k + 1] in REDIRECTS:
                    raise ValueError(f"{part[k]!r} without its operand: {line!r}")
                if part[k] == "<<":  # the here-document: the lines up to its tag, as written
                    tag = part[k + 1]
                    end = next((n for n in range(i, len(lines)) if lines[n].strip() == tag), None)
                    if end is None:
                        raise ValueError(f"a here-document without its closing {tag}: {line!r}")
                    cmd.heredoc, i = "\n".join(lines[i:end]) + "\n", end + 1
                else:
                    cmd.writes = part[k + 1]
                k += 2
            n = 0
            while n < len(words) and re.match(r"[A-Za-z_]\w*=", words[n]):
                n += 1
            if n == len(words):  # NAME=VALUE ...: the block's own variables
                variables.update(w.split("=", 1) for w in words)
                continue
            # NAME=VALUE before a command is only its environment
            cmd.argv = [x for w in words[n:] for x in _expand(w, variables)]
            commands.append(cmd)
    return commands


def _page_scripts(path: Path) -> dict[str, str]:
    """The files a page saves from its Python blocks: a block whose first line is `# NAME.py: ...`."""
    return {m[1]: code for lang, code in _blocks(path)
            if lang == "python" and (m := re.match(r"# (\w+\.py):", code))}


@contextlib.contextmanager
def _usage_errors():
    """A parser's usage error (its exit) as a failure with the parser's own message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            yield
    except SystemExit as e:
        raise AssertionError(f"refused (exit {e.code}): {err.getvalue().strip()}") from None


class _Checker:
    """Checks one page's commands in order, in a fresh directory `work` (the current one):
    what a page's command writes there (a here-document's file, a run's run.json and
    tokenizer.json) is there for the commands after it."""

    def __init__(self, path: Path, work: Path):
        self.work, self.scripts, self.written = work, _page_scripts(path), set()
        for name, text in {**self.scripts, **USER_FILES}.items():
            (work / name).write_text(text)
        self.page_text = path.read_text()

    def check(self, c: Command) -> str:
        argv, scripts = c.argv, PYPROJECT["project"]["scripts"]
        if tuple(argv) in SKIP:
            return "skipped"
        placeholders = [w for w in argv if re.fullmatch(r"<[^>]*>|[A-Z][A-Z0-9_]+|\.\.\.", w)]
        assert not placeholders, f"placeholders {placeholders}: give a concrete example (or PLACEHOLDERS a value)"
        if argv == ["cat"] and c.writes and c.heredoc is not None:
            (self.work / c.writes).write_text(c.heredoc)
            self.written.add(c.writes)
            return "shell"
        assert c.writes is None and c.heredoc is None, "a redirection this check does not know"
        if argv[:3] == ["python3", "-m", "venv"] and len(argv) == 4:
            return "install"
        if argv[:3] == ["pip", "install", "-e"] and len(argv) == 4:
            m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", argv[3])
            assert m, f"pip install -e {argv[3]}: not the checkout (.) with extras"
            unknown = set(m[1].split(",") if m[1] else ()) - set(PYPROJECT["project"]["optional-dependencies"])
            assert not unknown, f"extras that pyproject.toml does not declare: {sorted(unknown)}"
            return "install"
        if argv[0] == "bash" and len(argv) >= 2:
            self._script(argv[1], argv[2:])
            return "parsed"
        if argv[0] in scripts:
            module, func = scripts[argv[0]].split(":")
            run = [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())"]
            return self._module(module, argv[1:], argv[0], run)
        if argv[0] in ("python", "python3") and argv[1:2] == ["-m"] and len(argv) >= 3:
            return self._module(argv[2], argv[3:], f"python -m {argv[2]}", [sys.executable, "-m", argv[2]])
        if argv[0] in ("python", "python3") and len(argv) >= 2 and argv[1] in self.written:
            proc = subprocess.run([sys.executable, "-c", LAUNCHER, *argv[1:]], cwd=self.work,
                                  env=subprocess_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                                  timeout=120)
            assert proc.returncode == 0, f"the script, up to its command line:\n{proc.stderr[-3000:]}"
            return "parsed"
        if argv[0] in ("python", "python3") and argv[1:] and argv[1] in self.scripts:
            assert len(argv) == 2, "a saved Python block takes no arguments"
            return "run"  # the page's Python block itself: test_python_block_runs runs it
        raise AssertionError("no check for this command: run it (CHEAP), parse it, or list it in SKIP")

    def _module(self, module: str, args: list[str], prog: str, run: list[str]) -> str:
        if module in EXTERNAL:
            assert importlib.util.find_spec(module), f"{module} is not installed"
            return "external"
        assert importlib.util.find_spec(module), f"no module {module}"
        if args[-1:] == ["--help"] or module in CHEAP:
            proc = subprocess.run([*run, *args], cwd=ROOT, env=subprocess_env(PYTHONPATH=str(ROOT)),
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"
            return "run"
        if module in TRAINING:
            self._train(args, prog)
            return "parsed"
        mod = importlib.import_module(module)
        parse = getattr(mod, "parse_args", None)
        if parse is None:
            assert hasattr(mod, "build_parser"), f"{module} has neither parse_args(argv) nor build_parser()"
            parse = mod.build_parser().parse_args
        with _usage_errors():
            parsed = parse(args)
        if module == "experiments.sweep":  # every point is a training command
            for point in mod.points(parsed.grid):
                self._train([*parsed.base, *mod.point_flags(point)], "python -m experiments.train")
        return "parsed"

    def _train(self, args: list[str], prog: str) -> None:
        from diloco_eqx.training import cli
        from diloco_eqx.training import tokenizer as tok_lib
        from diloco_eqx.training.loop import write_json

        with _usage_errors():
            cfg = cli.parse_run_config(args, cli.build_parser(prog, cli.DESCRIPTION))
        out = Path(cfg.out)
        if out.is_absolute():
            return
        out.mkdir(parents=True, exist_ok=True)  # what the run leaves that a later command reads
        write_json(out / "run.json", {"command": [prog, *args], "settings": cfg.flat()})
        kind, size = tok_lib.parse_spec(cfg.data.tokenizer)
        if kind == "bpe":
            tok_lib.train_bpe([self.page_text.encode()], size).save(out / "tokenizer.json")

    def _script(self, name: str, args: list[str]) -> None:
        path = ROOT / name
        assert path.is_file(), f"no script {name}"
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        usage = re.search(rf"^#\s+bash {re.escape(name)}((?: \S+)*)$", path.read_text(), re.M)
        assert usage, f"{name} has no `#   bash {name} ARGS` usage line"
        words = usage[1].split()
        required = [w for w in words if not w.startswith("[")]
        assert len(required) <= len(args) <= len(words), f"{name} takes {usage[1].strip() or 'no arguments'}"


SHELL_BLOCKS = [(path, i, code) for path in SHELL_PAGES
                for i, code in enumerate(code for lang, code in _blocks(path) if lang == "bash")]
SHELL_CHECKED = sorted({path for path, _, _ in SHELL_BLOCKS}, key=SHELL_PAGES.index)


def _check_page(path: Path, work: Path) -> list[tuple[int, Command]]:
    """Every command of the page's bash blocks checked in order in `work` (the current
    directory); (block, command) pairs, each command's kind set; the failures together."""
    checker, done, failures = _Checker(path, work), [], []
    for _, index, code in (b for b in SHELL_BLOCKS if b[0] == path):
        for c in _bash_commands(code):
            try:
                c.kind = checker.check(c)
            except Exception as e:  # noqa: BLE001 - every failing command is reported, not the first
                failures.append(f"{_name(path)} bash block {index}: {c.line}\n  {type(e).__name__}: {e}")
            done.append((index, c))
    assert not failures, "\n".join(failures)
    return done


@pytest.mark.parametrize("path", SHELL_CHECKED, ids=_name)
def test_shell_commands_run_or_parse(path, tmp_path, monkeypatch):
    """Each command of a page's bash blocks: a cheap one (`--help`, CHEAP) runs as printed
    from the repository root; a training, benchmark or study command is read by its own
    parser (the training command's with `--model` and `--config`, a sweep's points too); an
    install names extras pyproject.toml declares; a prepared script passes `bash -n` and its
    usage line; only the SKIP commands are passed over."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    try:
        done = _check_page(path, tmp_path)
    finally:  # the page's own modules (my_model) leave with its directory
        for name in set(sys.modules) - before:
            if str(tmp_path) in str(getattr(sys.modules[name], "__file__", None) or ""):
                del sys.modules[name]
    assert done and all(c.kind for _, c in done)


def test_shell_blocks_are_found_and_tagged_bash():
    names = {_name(path) for path, _, _ in SHELL_BLOCKS}
    assert {"README.md", "docs/tutorial.md", "docs/multi-device.md", "benchmarks/README.md"} <= names
    for path in SHELL_PAGES:
        tags = {lang for lang, _ in _blocks(path)}
        assert not tags & {"sh", "shell", "console", "shell-session", "zsh", "Bash"}, _name(path)


def test_shell_block_parsing():
    code = textwrap.dedent("""\
        A="--x 1 --y" python -m m --z \\
            --w "two words" # a comment "quoted"
        V="--a 1 --b"
        cmd1 && cmd2 $V; cmd3 --p $RANK &
        cat > f.py <<'EOF'
        print("$NOT_EXPANDED") && x  # kept
        EOF
        last "# not a comment"
        """)
    got = [(c.argv, c.writes, c.heredoc) for c in _bash_commands(code)]
    assert got == [
        (["python", "-m", "m", "--z", "--w", "two words"], None, None),
        (["cmd1"], None, None), (["cmd2", "--a", "1", "--b"], None, None), (["cmd3", "--p", "0"], None, None),
        (["cat"], "f.py", 'print("$NOT_EXPANDED") && x  # kept\n'),
        (["last", "# not a comment"], None, None)]
    for bad, why in [("a $UNSET", "neither set"), ("a && && b", "empty command"), ("a 2>&1", "operator"),
                     ("a <<EOF\nb", "closing EOF"), ("a x$V", "inside it")]:
        with pytest.raises(ValueError, match=why):
            _bash_commands(bad)


def test_shell_tables_are_in_use():
    """Each SKIP command, placeholder and user file is one some page needs: the lists stay narrow."""
    commands = [tuple(c.argv) for _, _, code in SHELL_BLOCKS for c in _bash_commands(code)]
    text = "\n".join(code for _, _, code in SHELL_BLOCKS)
    assert all(skip in commands for skip in SKIP), set(SKIP) - set(commands)
    assert all(re.search(rf"\${name}\b", text) for name in PLACEHOLDERS)
    assert all(f"from {Path(name).stem} import" in text for name in USER_FILES)
