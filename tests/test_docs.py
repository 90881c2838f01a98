"""The newcomer's path through the docs: the README's map reaches the transfer README, whose reading path names real
code."""

from __future__ import annotations

import ast
import inspect
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"^\d+\. `(?P<file>[\w/.]+\.py):(?P<name>[\w.]+)`", re.M)


def defined_names(path: Path) -> set[str]:
    """Every function and class in ``path``, methods as ``Class.method``."""
    names: set[str] = set()

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(prefix + child.name)
                if isinstance(child, ast.ClassDef):
                    walk(child, f"{prefix}{child.name}.")

    walk(ast.parse(path.read_text()), "")
    return names


def reading_path() -> list[tuple[str, str]]:
    text = (ROOT / "pdkv/transfer/README.md").read_text()
    section = text.split("## Reading path", 1)[1].split("\n## ", 1)[0]
    return [(m["file"], m["name"]) for m in STEP.finditer(section)]


def test_the_reading_path_walks_every_stage() -> None:
    text = (ROOT / "pdkv/transfer/README.md").read_text()
    for stage in ("keyed", "sent", "landed", "verified", "freed"):
        assert f"**{stage}**" in text
    assert len(reading_path()) >= 25


@pytest.mark.parametrize(("file", "name"), reading_path(), ids=lambda v: v)
def test_each_step_of_the_reading_path_names_a_function_that_exists(file: str, name: str) -> None:
    path = ROOT / file
    assert path.is_file(), f"{file} (named in pdkv/transfer/README.md) does not exist"
    assert name in defined_names(path), f"{file} defines no {name} (named in pdkv/transfer/README.md)"


def test_the_readme_map_links_the_folder_readmes() -> None:
    readme = (ROOT / "README.md").read_text()
    for folder in ("pdkv/transfer/README.md", "channels/README.md"):
        assert f"({folder})" in readme, f"README.md's map does not link {folder}"
        assert (ROOT / folder).is_file()


# What ran on a GPU: benchmarks/gpu/ holds each lent machine's JSON (tests/gpu/check.py, tests/gpu/vllm_connector.py).
# Each part below passed in a run when its JSON says so; the docs may not say it never ran once one did.
GPU_RUNS = ROOT / "benchmarks/gpu"
PartCheck = Callable[[dict[str, Any]], bool]
CHECK_PY_PARTS: dict[str, PartCheck] = {  # tests/gpu/check.py: its "parts", each by what proves it right
    "gather_scatter": lambda p: (
        bool(p.get("cuda_kernel") and p.get("rows"))
        and all(r["gather_bit_exact"] and r["scatter_bit_exact"] for r in p["rows"])
    ),
    "checksum": lambda p: p.get("cpu_equals_cuda") is True,
    "checksums_batched": lambda p: (
        p.get("native_cuda") is True
        and p.get("waits_for_the_callers_stream") is True
        and all(c["equal"] for c in p.get("cases", []))
    ),
    "cache_engine": lambda p: p.get("bit_exact") is True,
    "transfer_tcp": lambda p: any(r["kv_memory"] == "cuda" for r in p.get("results", [])),  # through pinned staging
    "transfer_nixl": lambda p: any(r["path"] == "direct device (cuda)" for r in p.get("results", [])),  # VRAM to VRAM
    "nixl_vram_raw": lambda p: all(v["rc"] == 0 and v["gbps"] for v in p.values() if isinstance(v, dict)),
    "faults": lambda p: p.get("ok") is True,
}
# Parts check.py has that no lent machine has run yet: their docs may say so, until a run shows one passing.
NOT_YET_ON_A_GPU = {"faults", "checksums_batched"}
# A claim that a part never ran names it in its sentence, by these words, first match wins; a claim naming none is
# about the whole GPU path. vLLM itself has no part: the lent image has no vLLM, so no JSON can show it ran.
CLAIM_NAMES_PART: tuple[tuple[str | None, re.Pattern[str]], ...] = tuple(
    (part, re.compile(words, re.I))
    for part, words in (
        (None, r"GPU vLLM|vLLM itself|inside vLLM"),
        ("faults", r"\bfault"),
        ("vllm_connector", r"vllm_connector|connector|DeviceOrder|CUDA events"),
        ("transfer_nixl", r"VRAM|nixl"),
        ("cache_engine", r"KVCacheEngine|cache_engine|CUDA buffers"),
        ("gather_scatter", r"gather|scatter|kvcopy_cuda"),
        ("checksums_batched", r"checksums_batched|blocks_checksums"),
        ("checksum", r"checksum"),
        ("transfer_tcp", r"pinned staging|DeviceStager|staging"),
    )
)
NEVER_RAN = re.compile(r"\b(?:not|never)\s+(?:yet\s+)?(?:been\s+)?(?:run|ran|tested)\b|\buntested\b", re.I)
ON_A_GPU = re.compile(
    r"\bon an? (?:GPU|H[12]00)\b|\bno GPU\b|\bVRAM\b|\bCUDA (?:buffers|paths?|tensors|written)\b",
    re.I,
)
HISTORY = ROOT / "benchmarks/history"  # moved verbatim: what was true then, not checked against today


def passed_parts(run: dict[str, Any]) -> set[str]:
    """The parts one JSON of benchmarks/gpu/ shows passing."""
    if "cases" in run:  # tests/gpu/vllm_connector.py: every case loaded, bit-exact, ordered by real CUDA events
        cases = run["cases"].values()
        ok = bool(cases) and all(c["loaded"] and c["bit_exact"] and c["event_type"] == "_CudaEvent" for c in cases)
        return {"vllm_connector"} if ok else set()
    return {
        name
        for name, check in CHECK_PY_PARTS.items()
        if name in run["parts"] and not {"error", "skipped"} & run["parts"][name].keys() and check(run["parts"][name])
    }


def gpu_runs() -> dict[str, set[str]]:
    return {path.name: passed_parts(json.loads(path.read_text())) for path in sorted(GPU_RUNS.glob("*.json"))}


def doc_files() -> list[Path]:
    """The READMEs and the code's docstrings and comments: every .md and .py of the tree but the history."""

    def ours(part: str) -> bool:  # not a build's, an environment's or a hidden folder's copy
        return not (part.startswith(".") or part.endswith(".egg-info") or part in {"build", "build-inplace", "venv"})

    return sorted(
        path
        for suffix in ("*.md", "*.py")
        for path in ROOT.rglob(suffix)
        if all(ours(part) for part in path.relative_to(ROOT).parts[:-1])
        and not path.is_relative_to(HISTORY)
        and path != Path(__file__).resolve()
    )


def sentences(text: str) -> list[str]:
    """Paragraphs, table cells and sentences, each on one line."""
    out: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text):
        flat = " ".join(paragraph.split())
        out += [s for s in re.split(r"(?<=[.!?])\s+|\s\|\s", flat) if s]
    return out


def never_ran_claims(text: str, ran: set[str]) -> list[str]:
    """Each sentence of ``text`` saying a part never ran on a GPU while a run in ``ran`` shows it did."""
    wrong = []
    for sentence in sentences(text):
        if not (NEVER_RAN.search(sentence) and ON_A_GPU.search(sentence)):
            continue
        part = next((part for part, words in CLAIM_NAMES_PART if words.search(sentence)), "the GPU path")
        if (part == "the GPU path" and ran) or part in ran:
            wrong.append(f"{sentence!r} (about {part})")
    return wrong


def test_the_gpu_runs_show_what_passed() -> None:
    runs = gpu_runs()
    assert runs, "benchmarks/gpu/ holds no run"
    passed = set().union(*runs.values())
    assert set(CHECK_PY_PARTS) - NOT_YET_ON_A_GPU | {"vllm_connector"} == passed, runs
    assert not passed & NOT_YET_ON_A_GPU, f"{passed & NOT_YET_ON_A_GPU} ran on a GPU: take it out of NOT_YET_ON_A_GPU"


def test_no_doc_says_a_part_never_ran_on_a_gpu_that_did() -> None:
    ran = set().union(*gpu_runs().values())
    wrong = [f"{path.relative_to(ROOT)}: {c}" for path in doc_files() for c in never_ran_claims(path.read_text(), ran)]
    assert not wrong, "benchmarks/gpu/ holds a passing run of what these say never ran on a GPU:\n" + "\n".join(wrong)


def test_the_never_ran_check_catches_such_claims() -> None:
    ran = {"transfer_nixl", "cache_engine", "vllm_connector"}
    assert never_ran_claims("CUDA tensors register as VRAM; that path is written but has not been run.", ran)
    assert never_ran_claims("CUDA buffers (written, NOT run: no GPU here): gathers run on the device.", ran)
    assert never_ran_claims("Ordering on a GPU (``ordering.DeviceOrder``; not run here: no GPU): the push", ran)
    assert never_ran_claims("By its author; not yet run on a GPU.", ran)  # names no part: the whole path
    assert not never_ran_claims("On a GPU vLLM (not run): layouts.", ran)  # vLLM itself: nothing shows it ran
    assert not never_ran_claims("CUDA buffers (written, NOT run: no GPU here): gathers.", {"transfer_nixl"})
    assert not never_ran_claims("Where they do not run (no native library, small units on CUDA) torch ops", ran)


def test_results_lists_every_gpu_run_with_the_parts_it_passed() -> None:
    """RESULTS's "On a GPU" table: a row per run, naming its JSON files, "passed" as they say."""
    results = (ROOT / "benchmarks/RESULTS.md").read_text()
    assert "\n## On a GPU\n" in results, 'benchmarks/RESULTS.md has no section "On a GPU"'
    table = results.split("\n## On a GPU\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in table.splitlines() if re.match(r"\| \d", line)]
    runs, listed = gpu_runs(), set()
    for row in rows:
        files, claimed = re.findall(r"`([\w.-]+\.json)`", row[-1]), set(re.findall(r"`(\w+)`", row[2]))
        assert files, f"a row of RESULTS's GPU table names no JSON: {row}"
        assert claimed == set().union(*(runs[f] for f in files)), f"run {row[0]}: RESULTS says {claimed}"
        listed.update(files)
    assert listed == set(runs), f"benchmarks/gpu/ files missing from RESULTS's GPU table: {set(runs) - listed}"


# Pointers into other text: `FILE.md, "Heading"` (a heading, or a **bold** or *italic* label, containing the quoted
# words), and "see the module/package docstring for the X" (that docstring exists and speaks of X).
POINTER = re.compile(r"(?P<path>[\w./-]+\.md)\)?(?: here)?,?\s+(?:section\s+)?\"(?P<text>[^\"]{2,120})\"")
DOCSTRING_POINTER = re.compile(r"see the (?P<which>module|package) docstring(?: for the (?P<what>\w+))?", re.I)


def labels(markdown: str) -> list[str]:
    """What a quoted pointer into ``markdown`` may name: its headings and emphasized labels, on one line each."""
    found = re.findall(r"^#+\s+(.*)$", markdown, re.M)
    found += [bold or italic for bold, italic in re.findall(r"\*\*(.+?)\*\*|(?<!\*)\*([^*\s][^*]*?)\*", markdown)]
    return [" ".join(label.split()) for label in found]


def broken_pointers(path: Path, text: str) -> list[str]:
    broken = []
    flat = " ".join(text.split())
    for m in POINTER.finditer(flat):
        target = next((p for p in (path.parent / m["path"], ROOT / m["path"]) if p.is_file()), None)
        if target is None:
            broken.append(f"{m['path']} does not exist")
        elif not any(m["text"].lower() in label.lower() for label in labels(target.read_text())):
            broken.append(f"{m['path']} has no heading or label {m['text']!r}")
    for m in DOCSTRING_POINTER.finditer(flat):
        source = path.parent / "__init__.py" if m["which"].lower() == "package" else path
        docstring = ast.get_docstring(ast.parse(source.read_text())) if source.is_file() else None
        if not docstring:
            broken.append(f"{source.name} has no docstring ({m[0]!r})")
        elif m["what"] and m["what"].lower() not in docstring.lower():
            broken.append(f"{source.name}'s docstring does not speak of {m['what']!r} ({m[0]!r})")
    return broken


def test_every_pointer_into_other_text_finds_it() -> None:
    wrong = [f"{path.relative_to(ROOT)}: {b}" for path in doc_files() for b in broken_pointers(path, path.read_text())]
    assert not wrong, "pointers to text that is not there:\n" + "\n".join(wrong)


def test_the_pointer_check_catches_what_is_not_there(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("# Doc\n\n## Wire format\n\n- **The late-write fence.** Held.\n")
    (tmp_path / "__init__.py").write_text('"""The package: its frames are in README.md."""\n')
    here = tmp_path / "channel.py"
    assert broken_pointers(here, 'See README.md, "The fixed cost of one request".')  # no such heading
    assert broken_pointers(here, 'See NOPE.md, "Wire format".')  # no such file
    assert broken_pointers(here, "See the package docstring for the protocol and its guarantees.")  # not there
    assert broken_pointers(here, "See the module docstring.")  # channel.py does not exist, so has none
    assert not broken_pointers(here, 'The frames: README.md, "Wire format"; see the package docstring for the frames')
    assert not broken_pointers(here, 'The hold: README.md here, "The late-write fence".')  # a bold label counts


def test_the_readme_names_every_bench_the_cli_has_and_no_other() -> None:
    """README's "Measured" names the benches as ``pdkv bench a|b|...``: exactly the CLI's, so the list cannot drift
    from what runs."""
    import argparse

    from pdkv.cli import build_parser

    listed = re.search(r"`pdkv bench ([\w|-]+)`", (ROOT / "README.md").read_text())
    assert listed, "README.md names no `pdkv bench a|b|...` list"
    bench = next(a.choices["bench"] for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    benches = next(a.choices for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    assert listed.group(1).split("|") == list(benches), "README.md's bench list differs from `pdkv bench --help`"


def interface_names(text: str) -> tuple[set[str], set[str]]:
    """The bare and the dotted code names (``name``, ``name(...)``, ``Class.member``) in a README section."""
    bare: set[str] = set()
    dotted: set[str] = set()
    for token in re.findall(r"`([A-Za-z_][\w.]*)(?:\([^`]*\))?`", text):
        if not token.endswith((".py", ".md")):  # a file, not a name
            (dotted if "." in token else bare).add(token)
    return bare, dotted


def test_the_channel_interface_is_described_once_and_as_base_py_has_it() -> None:
    """channels/README.md's "The interface" is the one description of ``Channel``: it names every public member, and
    every name it uses is a member (or a ``Class.member`` of the channel package that exists), so the two cannot
    drift apart again (they did over ``write_blocks``)."""
    import pdkv.channels.base as base

    text = (ROOT / "channels/README.md").read_text()
    section = text[text.index("## The interface\n") : text.index("\n## ", text.index("## The interface\n") + 1)]
    bare, dotted = interface_names(section)
    members = {name for name in vars(base.Channel) if not name.startswith("_")} | {"name"}
    assert not members - bare, f"channels/README.md, The interface, does not name {sorted(members - bare)}"
    types = {name for name in bare if name[0].isupper()}
    assert all(hasattr(base, name) for name in types - members), f"not in channels/base.py: {sorted(types - members)}"
    unknown = bare - members - types
    assert not unknown, f"channels/README.md, The interface, names {sorted(unknown)}: not members of Channel"
    for name in dotted:
        owner, member = name.split(".", 1)
        cls = getattr(base, owner, None)
        has = hasattr(cls, member) or (cls is not None and f"self.{member} =" in inspect.getsource(cls))
        assert has, f"channels/README.md names {name}: no such member"


def test_the_interface_check_catches_a_name_that_is_not_a_member() -> None:
    text = "`write_blocks(..., inline=True)` then `poll`, `TransferHandle.answer`, `a.b` in `base.py`"
    bare, dotted = interface_names(text)
    assert bare == {"write_blocks", "poll"} and dotted == {"TransferHandle.answer", "a.b"}
