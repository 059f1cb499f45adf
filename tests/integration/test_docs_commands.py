"""The documentation cannot drift from the code: every command in README.md, docs/*.md and
examples/**/README.md names a program that exists and only options that program accepts.

What is read: every fenced code block tagged ``bash``, ``sh``, ``shell``, ``console`` or untagged
(output blocks are untagged too: their lines are skipped because they name no known program),
with backslash continuations joined and comments dropped; each line is split into simple
commands at ``;``, ``&&``, ``||``, ``|`` and ``&``. A command is checked when its program is

* a console script of ``pyproject.toml`` (``sdma-redundancy``, ``.venv/bin/vae-eval``, ...): it must
  be declared and installed in the venv, and every ``--long-option`` of the line must appear in
  its ``--help`` (of the subcommand, for ``vae-generate interpolate`` and the like);
* ``fairseq-train``, ``-generate``, ``-interactive``, ``-preprocess``, ``-hydra-train``: fairseq's
  ``--help`` stops before the task, model and criterion add their options, so the parser is
  built the way fairseq builds it (``options.parse_args_and_arch``) with ``--user-dir
  <REPO>/user_dir`` and the line's ``--task``, ``--arch``, ``--criterion``, ``--optimizer``,
  ``--lr-scheduler``; ``fairseq-hydra-train`` against Hydra's own command line;
* a ``.py`` file of the repository run by python, or ``python -m`` one of the project's modules:
  the file must exist, options as above;
* a ``.sh`` file of the repository (``scripts/``, ``examples/``): it must exist and be
  executable; its options are checked against its header comment (what its ``--help``
  prints) when that lists any, and the options after ``--`` of the SDMA recipes against
  ``fairseq-train``;
* ``make TARGET``: the target (and any ``VAR=value``) must be in the Makefile.

Besides: every repository path the pages mention (``examples/...``, ``scripts/...``,
``user_dir/...``, ``latent_core/...``, ``pipelines/...``, ``espnet_plugin/...``,
``transformers_plugin/...``, ``benchmarks/...``, ``experiments/...``, ``docs/...``, ``tests/...``)
exists, every relative Markdown link resolves (anchors included), every dotted reference to the
project's modules (``latent_core.sdma.SDMAOptions``) names a module and a name defined in it, and the
Commands table of docs/commands.md lists exactly the console scripts of ``pyproject.toml``.

All ``--help`` texts come from one helper process (imports shared, about half a minute).
"""

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

import pytest

from conftest import REPO, venv_bin

pytestmark = pytest.mark.integration

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").glob("**/README.md"))]
COMMANDS_PAGE = REPO / "docs" / "commands.md"  # the table of every console script
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
FAIRSEQ = {"fairseq-train", "fairseq-generate", "fairseq-interactive", "fairseq-preprocess", "fairseq-hydra-train"}
FAIRSEQ_SELECTORS = ("--task", "--arch", "-a", "--criterion", "--optimizer", "--lr-scheduler")
PROJECT_PACKAGES = ("latent_core", "pipelines", "user_dir", "espnet_plugin", "transformers_plugin", "benchmarks",
                    "experiments")
PATH_PREFIXES = ("examples", "scripts", "user_dir", "latent_core", "pipelines", "espnet_plugin", "transformers_plugin",
                 "benchmarks", "experiments", "docs", "tests")
LONG_OPTION = re.compile(r"(?<![\w-])--[A-Za-z0-9][\w-]*")
MIN_COMMANDS = 30


def console_scripts() -> Dict[str, str]:
    """name -> "module:function" of pyproject.toml's ``[project.scripts]``."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"].get("scripts")
    assert scripts, "pyproject.toml declares no [project.scripts]"
    return dict(scripts)


SCRIPTS = console_scripts()
# a hyphenated name with the first word of one of ours (sdma-, vae-, prepare-, ...) is taken for
# one of ours, so that a misspelt command fails instead of being skipped as someone else's
COMMAND_PREFIXES = {name.split("-")[0] for name in SCRIPTS if "-" in name}


# ----------------------------------------------------------------------------- reading the docs

class Command(NamedTuple):
    doc: str          # file:line
    kind: str         # entry | fairseq | pyfile | module | shell | make
    program: str      # console script name, fairseq command, repo-relative file, module, "make"
    args: Tuple[str, ...]
    text: str


def code_blocks(path: Path):
    """(first line number, language, lines) of each fenced block."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*```\s*([\w+-]*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        lang, start, body = m.group(1).lower(), i + 2, []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        i += 1
        yield start, lang, body


def logical_lines(start: int, lang: str, body: List[str]):
    """(line number, text) with backslash continuations joined; console blocks: prompts only."""
    pending, first = "", start
    for offset, line in enumerate(body):
        if lang == "console":
            if not pending:
                if not line.lstrip().startswith("$ "):
                    continue
                line = line.lstrip()[2:]
        if not pending:
            first = start + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield first, pending + line
        pending = ""
    if pending:
        yield first, pending


def split_commands(text: str) -> List[List[str]]:
    """Simple commands of a shell line (comments, redirections and separators removed)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: not a shell line
        return []
    commands, current, skip_next = [], [], False
    for token in tokens:
        if skip_next:
            skip_next = False
            continue
        if token and set(token) <= set(";&|()"):
            if current:
                commands.append(current)
            current = []
        elif token and set(token) <= set("<>&"):
            skip_next = True  # the redirection's file
        else:
            current.append(token)
    if current:
        commands.append(current)
    return commands


def is_repo_file_token(token: str) -> bool:
    token = token[2:] if token.startswith("./") else token
    return token.startswith(("scripts/", "examples/")) and token.endswith((".py", ".sh"))


def classify(tokens: List[str]) -> Optional[Tuple[str, str, List[str]]]:
    """(kind, program, args) of a simple command, or None when it is not one of ours."""
    while tokens and (re.match(r"^[A-Za-z_]\w*=", tokens[0]) or tokens[0] in {"do", "then", "else", "time", "env"}):
        tokens = tokens[1:]
    if not tokens:
        return None
    head, rest = tokens[0], tokens[1:]
    name = head.rsplit("/", 1)[-1] if head.startswith((".venv/bin/", "$VIRTUAL_ENV/bin/")) else head
    if name == "make":
        return "make", "make", rest
    if name in FAIRSEQ:
        return "fairseq", name, rest
    if name in SCRIPTS or ("-" in name and name.split("-")[0] in COMMAND_PREFIXES | {"fairseq"}):
        return "entry", name, rest
    if name in {"python", "python3"} or head.endswith("/python"):
        if rest[:1] == ["-m"] and len(rest) > 1 and rest[1].split(".")[0] in PROJECT_PACKAGES:
            return "module", rest[1], rest[2:]
        if rest and is_repo_file_token(rest[0]):
            return "pyfile", rest[0].removeprefix("./"), rest[1:]
        return None
    if is_repo_file_token(head):
        kind = "shell" if head.endswith(".sh") else "pyfile"
        return kind, head.removeprefix("./"), rest
    return None


def documented_commands() -> List[Command]:
    commands = []
    for doc in DOCS:
        rel = doc.relative_to(REPO)
        for start, lang, body in code_blocks(doc):
            if lang not in SHELL_LANGS:
                continue
            for lineno, text in logical_lines(start, lang, body):
                for tokens in split_commands(text):
                    found = classify(tokens)
                    if found:
                        kind, program, args = found
                        commands.append(Command(f"{rel}:{lineno}", kind, program, tuple(args), text.strip()))
    return commands


COMMANDS = documented_commands()


def options_of(args, stop_at_double_dash=True) -> List[str]:
    out = []
    for arg in args:
        if arg == "--" and stop_at_double_dash:
            break
        if arg.startswith("--") and len(arg) > 2:
            out.append(arg.split("=", 1)[0])
    return out


def after_double_dash(args) -> List[str]:
    return list(args[list(args).index("--") + 1:]) if "--" in args else []


def first_positional(args) -> Optional[str]:
    """The first argument when it is not an option: a candidate subcommand (``vae-generate
    interpolate``); the helper uses it only when the program's usage lists it as one."""
    return args[0] if args and not args[0].startswith("-") else None


def fairseq_selectors(args) -> List[str]:
    selectors, args = ["--user-dir", str(REPO / "user_dir")], list(args)
    for i, arg in enumerate(args[:-1]):
        if arg in FAIRSEQ_SELECTORS:
            selectors += [arg, args[i + 1]]
    return selectors


# ----------------------------------------------------------------------------- shell scripts

def header_comment(path: Path) -> str:
    lines = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if i == 0 and line.startswith("#!"):
            continue
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


def shell_help(path: Path) -> str:
    """A shell script's help: its header comment and those of the files it sources."""
    text = path.read_text(encoding="utf-8")
    parts = [header_comment(path)]
    for name in re.findall(r"^\s*(?:source|\.)\s+[^\n]*?([\w.-]+\.sh)\"?\s*$", text, flags=re.M):
        sourced = path.parent / name
        if sourced.exists():
            parts.append(header_comment(sourced))
    return "\n".join(parts)


def shell_passthrough(path: Path) -> Optional[List[str]]:
    """fairseq-train selectors for the options after ``--`` of an SDMA recipe script."""
    text = path.read_text(encoding="utf-8")
    m = re.search(r"^run_fairseq_train\s+\S+\s+\S+\s+[^\n]*?(\w+_transformer\w*)", text, flags=re.M)
    if not m:
        return None
    common = "\n".join((path.parent / n).read_text(encoding="utf-8")
                       for n in re.findall(r"^\s*(?:source|\.)\s+[^\n]*?([\w.-]+\.sh)\"?\s*$", text, flags=re.M)
                       if (path.parent / n).exists())
    selectors = ["--user-dir", str(REPO / "user_dir"), "--arch", m.group(1)]
    for flag in ("--task", "--criterion", "--optimizer", "--lr-scheduler"):
        found = re.search(re.escape(flag) + r"\s+([\w-]+)", common)
        if found:
            selectors += [flag, found.group(1)]
    return selectors


# ----------------------------------------------------------------------------- help texts

HELPER = r'''
import contextlib, importlib, io, json, runpy, subprocess, sys
jobs = json.loads(sys.stdin.read())

def capture(fn):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            fn()
        except SystemExit:
            pass
        except BaseException as error:  # reported, not raised: one broken program fails its own check
            out.write("\n<<helper: %s: %s>>" % (type(error).__name__, error))
    return out.getvalue()

def fairseq_parser(program, selectors):
    from fairseq import options
    if program == "fairseq-preprocess":
        return options.get_preprocessing_parser().format_help()
    if program == "fairseq-hydra-train":
        from hydra._internal.utils import get_args_parser  # the command line of every @hydra.main
        # its help strings are lazy objects that argparse cannot format: list the option strings
        return " ".join(s for action in get_args_parser()._actions for s in action.option_strings)
    make = {"fairseq-train": options.get_training_parser,
            "fairseq-generate": options.get_generation_parser,
            "fairseq-interactive": options.get_interactive_generation_parser}[program]
    parser = make()
    options.parse_args_and_arch(parser, input_args=["DATA"] + selectors, parse_known=True)
    return parser.format_help()

def run(kind, target, argv):
    if kind == "entry":
        module, function = target.split(":")
        def call():
            sys.argv = [target, *argv]
            getattr(importlib.import_module(module), function)()
        return capture(call)
    if kind == "pyfile":  # a script is run as a program, as the docs run it
        proc = subprocess.run([sys.executable, target, *argv], capture_output=True, text=True)
        return proc.stdout + proc.stderr
    if kind == "module":
        def call():
            sys.argv = [target, *argv]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        return capture(call)
    if kind == "fairseq":
        holder = {}
        text = capture(lambda: holder.setdefault("help", fairseq_parser(target, argv)))
        return holder.get("help", text)
    raise ValueError(kind)

import re
results = {}
for key, (kind, target, selectors, sub) in jobs.items():
    text = run(kind, target, list(selectors) + ([] if kind == "fairseq" else ["--help"]))
    entry = {"help": text}
    usage = text.split("\n\n", 1)[0]
    choices = re.search(r"\{([\w-]+(?:,[\w-]+)+)\}\s*\.\.\.", usage)
    if sub and choices and sub in choices.group(1).split(","):
        entry["sub_help"] = run(kind, target, [sub, "--help"])
    results[key] = entry
sys.stdout.write("\n<<JSON>>" + json.dumps(results))
'''


def help_job(command: Command) -> Optional[Tuple[str, list]]:
    """(key, job) of the --help text a command's options are checked against; job = [kind,
    target, arguments before --help, candidate subcommand]."""
    sub = first_positional(command.args)
    if command.kind == "entry":
        job = ["entry", SCRIPTS[command.program], [], sub]
    elif command.kind == "fairseq":
        job = ["fairseq", command.program, fairseq_selectors(command.args), None]
    elif command.kind == "pyfile":
        job = ["pyfile", str(REPO / command.program), [], sub]
    elif command.kind == "module":
        job = ["module", command.program, [], sub]
    else:
        return None
    return json.dumps(job), job


def passthrough_job(command: Command) -> Optional[Tuple[str, list]]:
    """(key, job) of fairseq-train's parser for the options after ``--`` of an SDMA recipe."""
    path = REPO / command.program
    if command.kind != "shell" or not path.is_file() or not after_double_dash(command.args):
        return None
    selectors = shell_passthrough(path)
    if not selectors:
        return None
    job = ["fairseq", "fairseq-train", selectors, None]
    return json.dumps(job), job


@pytest.fixture(scope="module")
def helps() -> Dict[str, dict]:
    """key -> {"help": text, "sub_help": text of the subcommand, when the job names one}."""
    jobs = {}
    for command in COMMANDS:
        if not program_exists(command)[0]:
            continue
        for found in (help_job(command), passthrough_job(command)):
            if found:
                jobs.setdefault(*found)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", HELPER], input=json.dumps(jobs), cwd=REPO,
                          capture_output=True, text=True, timeout=900, env=env)
    assert "<<JSON>>" in proc.stdout, f"the --help helper failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.rsplit("<<JSON>>", 1)[1])


def help_text(helps: Dict[str, dict], found: Tuple[str, list]) -> str:
    entry = helps.get(found[0], {})
    return entry.get("sub_help") or entry.get("help", "")


# ----------------------------------------------------------------------------- checks

def makefile_targets() -> Tuple[set, str]:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, flags=re.M))
    return targets, text


def program_exists(command: Command) -> Tuple[bool, str]:
    if command.kind == "entry":
        if command.program not in SCRIPTS:
            return False, f"{command.program} is not a console script of pyproject.toml"
        if not Path(venv_bin(command.program)).exists():
            return False, f"console script {command.program} is declared in pyproject.toml but not installed " \
                          f"(pip install -e . again)"
        return True, ""
    if command.kind == "fairseq":
        return Path(venv_bin(command.program)).exists(), f"{command.program} is not installed in the venv"
    if command.kind in {"pyfile", "shell"}:
        path = REPO / command.program
        if not path.is_file():
            return False, f"{command.program} does not exist"
        if command.kind == "shell" and not os.access(path, os.X_OK):
            return False, f"{command.program} is not executable"
        return True, ""
    if command.kind == "module":
        base = REPO.joinpath(*command.program.split("."))
        ok = base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()
        return ok, f"module {command.program} does not exist"
    if command.kind == "make":
        targets, text = makefile_targets()
        for arg in command.args:
            if "=" in arg:
                var = arg.split("=", 1)[0]
                if not re.search(rf"(^{var}\s*[?:]?=|\$\({var}\))", text, flags=re.M):
                    return False, f"the Makefile has no variable {var}"
            elif not arg.startswith("-") and arg not in targets:
                return False, f"the Makefile has no target {arg!r} (targets: {', '.join(sorted(targets))})"
        return True, ""
    raise ValueError(command.kind)


def test_the_docs_hold_enough_commands_to_check():
    kinds = {kind: sum(c.kind == kind for c in COMMANDS) for kind in {c.kind for c in COMMANDS}}
    assert len(COMMANDS) >= MIN_COMMANDS, f"only {len(COMMANDS)} commands found in the docs: {kinds}"
    assert {"entry", "fairseq", "shell", "make"} <= set(kinds), kinds
    assert all(doc.exists() for doc in DOCS) and len(DOCS) >= 6, DOCS
    assert COMMANDS_PAGE in DOCS, DOCS


def test_every_documented_program_exists():
    problems = []
    for command in COMMANDS:
        ok, why = program_exists(command)
        if not ok:
            problems.append(f"{command.doc}: {why}\n    {command.text}")
    assert not problems, "\n".join(problems)


def test_every_documented_option_is_accepted(helps):
    problems = []
    for command in COMMANDS:
        if not program_exists(command)[0] or command.kind == "make":
            continue
        if command.kind == "shell":
            path = REPO / command.program
            text = shell_help(path)
            accepted = set(LONG_OPTION.findall(text))
            if accepted:  # a header that documents options: check the line's against it
                for option in options_of(command.args):
                    if option not in accepted:
                        problems.append(f"{command.doc}: {command.program} has no option {option} "
                                        f"(its header lists {', '.join(sorted(accepted))})\n    {command.text}")
            found = passthrough_job(command)
            if found:
                accepted = set(LONG_OPTION.findall(help_text(helps, found)))
                for option in options_of(after_double_dash(command.args), stop_at_double_dash=False):
                    if option not in accepted:
                        problems.append(f"{command.doc}: fairseq-train (after --) has no option {option}\n"
                                        f"    {command.text}")
            continue
        text = help_text(helps, help_job(command))
        if "<<helper:" in text or not LONG_OPTION.search(text):
            problems.append(f"{command.doc}: `{command.program} --help` failed:\n{text[-1500:]}")
            continue
        accepted = set(LONG_OPTION.findall(text))
        for option in options_of(command.args):
            if option not in accepted:
                problems.append(f"{command.doc}: {command.program} has no option {option}\n    {command.text}")
    assert not problems, "\n".join(problems)


PATH_RE = re.compile(r"(?<![\w./$~-])((?:%s)/[\w./*<>{}-]*)" % "|".join(PATH_PREFIXES))


def test_every_repository_path_in_the_docs_exists():
    problems = []
    for doc in DOCS:
        for lineno, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for path in PATH_RE.findall(line):
                path = path.rstrip(".,:;")
                if any(c in path for c in "<>{}"):
                    continue  # a template such as examples/<paper>/README.md
                if "*" in path:
                    if not list(REPO.glob(path)):
                        problems.append(f"{doc.relative_to(REPO)}:{lineno}: nothing matches {path}")
                elif not (REPO / path).exists():
                    problems.append(f"{doc.relative_to(REPO)}:{lineno}: {path} does not exist")
    assert not problems, "\n".join(problems)


def github_anchor(heading: str) -> str:
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"\s", "-", text)


def anchors_of(path: Path) -> set:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {github_anchor(h) for h in re.findall(r"^#+\s+(.*)$", text, flags=re.M)}


def test_every_relative_link_resolves():
    problems = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            path = (doc.parent / file_part).resolve() if file_part else doc
            if not path.exists():
                problems.append(f"{doc.relative_to(REPO)}: link {target}: {path} does not exist")
            elif anchor and path.suffix == ".md" and anchor not in anchors_of(path):
                problems.append(f"{doc.relative_to(REPO)}: link {target}: no heading #{anchor} in {path.name}")
    assert not problems, "\n".join(problems)


def test_every_dotted_reference_to_the_project_resolves():
    problems = []
    pattern = re.compile(r"(?<![\w./])((?:%s)(?:\.\w+)+)" % "|".join(PROJECT_PACKAGES))
    for doc in DOCS:
        for lineno, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for dotted in pattern.findall(line):
                parts = dotted.split(".")
                for n in range(len(parts), 0, -1):
                    base = REPO.joinpath(*parts[:n])
                    source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
                    if source.is_file():
                        break
                else:
                    problems.append(f"{doc.relative_to(REPO)}:{lineno}: {dotted}: no such module")
                    continue
                if n == 1 and len(parts) > 1 and not base.is_dir():
                    problems.append(f"{doc.relative_to(REPO)}:{lineno}: {dotted}: no such module")
                    continue
                text = source.read_text(encoding="utf-8")
                for name in parts[n:]:
                    if not re.search(rf"\b{re.escape(name)}\b", text):
                        problems.append(f"{doc.relative_to(REPO)}:{lineno}: {dotted}: {name} is not in "
                                        f"{source.relative_to(REPO)}")
    assert not problems, "\n".join(problems)


def test_the_commands_page_lists_every_console_script():
    section = COMMANDS_PAGE.read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\|\s*`([\w-]+)`\s*\|\s*`([\w.]+)`\s*\|", section, flags=re.M))
    declared = {name: target.split(":")[0] for name, target in SCRIPTS.items()}
    assert rows == declared, (f"docs/commands.md's table differs from pyproject.toml: missing "
                              f"{sorted(set(declared) - set(rows))}, extra {sorted(set(rows) - set(declared))}, "
                              f"other module {sorted(k for k in rows if k in declared and rows[k] != declared[k])}")
