"""The library's structure (docs/architecture.md): which package imports which, the options dataclasses and
their keyword front end, and the one rule for the valid r of a layout; and the docs that describe it stay true to
the code: the module map and the options tables against the source, the sections the code cites, the links."""

from __future__ import annotations

import ast
import dataclasses
import math
import re
import struct
from pathlib import Path

import pytest
import torch

from flexmoe import ExpertOptions, MoELayer, ParallelOptions, RoutingOptions
from flexmoe.validation import constant_float

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "flexmoe"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside functions (absolute names)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("room, forbidden", [
    ("parallel", ("flexmoe.tuning", "flexmoe.apps", "flexmoe.routing")),
    ("routing", ("flexmoe.parallel", "flexmoe.tuning", "flexmoe.apps", "flexmoe.layer")),
    ("tuning", ("flexmoe.apps", "flexmoe.layer")),
])
def test_rooms_import_only_what_the_architecture_allows(room: str, forbidden: tuple[str, ...]) -> None:
    bad = []
    for path in sorted((SRC / room).glob("*.py")):
        for name in imported_modules(path):
            if name.startswith(forbidden):
                bad.append(f"{path.relative_to(SRC)} imports {name}")
    assert not bad, bad


def test_the_library_never_imports_the_applications() -> None:
    library = [p for p in SRC.rglob("*.py") if "apps" not in p.relative_to(SRC).parts and p.name != "__main__.py"]
    bad = [f"{p.relative_to(SRC)} imports {n}" for p in library for n in imported_modules(p)
           if n.startswith("flexmoe.apps")]
    assert not bad, bad


def test_only_flexmoe_hf_imports_transformers() -> None:
    """transformers is the optional extra of flexmoe.hf: no other library module imports it or flexmoe.hf."""
    library = [p for p in SRC.rglob("*.py") if p.relative_to(SRC).parts[0] not in ("apps", "hf")]
    bad = [f"{p.relative_to(SRC)} imports {n}" for p in library for n in imported_modules(p)
           if n.split(".")[0] == "transformers" or n.startswith("flexmoe.hf")]
    assert not bad, bad


def test_option_field_names_are_unique_across_the_dataclasses() -> None:
    names = [f.name for cls in (RoutingOptions, ExpertOptions, ParallelOptions) for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_keywords_and_dataclasses_build_the_same_layer() -> None:
    """The keyword front end and the dataclasses give the same options and the same outputs."""
    keywords = dict(k=1, capacity_factor=0.5, normalize_weights=False, activation="silu", glu=True,
                    shared_experts=1, r=1, overlap_degree=2)
    torch.manual_seed(0)
    by_keyword = MoELayer(8, 4, 16, **keywords)
    torch.manual_seed(0)
    by_options = MoELayer(8, 4, 16,
                          routing_options=RoutingOptions(k=1, capacity_factor=0.5, normalize_weights=False),
                          expert_options=ExpertOptions(activation="silu", glu=True, shared_experts=1),
                          parallel_options=ParallelOptions(overlap_degree=2))
    assert by_keyword.routing_options == by_options.routing_options
    assert by_keyword.expert_options == by_options.expert_options
    x = torch.randn(10, 8)
    assert torch.equal(by_keyword(x), by_options(x))
    # Layer attributes read the options; keywords given with an options object are applied on top.
    assert (by_keyword.k, by_keyword.capacity_factor, by_keyword.glu, by_keyword.overlap_degree) == (1, 0.5, True, 2)
    on_top = MoELayer(8, 4, 16, routing_options=RoutingOptions(k=1, capacity_factor=0.5), capacity_factor=2.0)
    assert (on_top.k, on_top.capacity_factor) == (1, 2.0)


def test_options_validate_themselves_and_unknown_keywords_fail() -> None:
    with pytest.raises(ValueError, match="capacity_factor must be finite"):
        RoutingOptions(capacity_factor=float("nan"))
    with pytest.raises(TypeError, match="shared_experts must be an int"):
        ExpertOptions(shared_experts=1.0)
    with pytest.raises(ValueError, match="overlap_degree must be an int >= 1"):
        ParallelOptions(overlap_degree=0)
    with pytest.raises(TypeError, match="token_exchange must be a bool, got 'rows'"):
        ParallelOptions(token_exchange="rows")
    with pytest.raises(TypeError, match="token_exchange must be a bool"):
        MoELayer(8, 4, 16)(torch.randn(3, 8), token_exchange=1)  # per call, validated the same way
    with pytest.raises(TypeError, match="unexpected keyword argument 'kk'"):
        MoELayer(8, 4, 16, kk=2)
    with pytest.raises(TypeError, match="routing_options must be a RoutingOptions"):
        MoELayer(8, 4, 16, routing_options=ExpertOptions())
    moe = MoELayer(8, 4, 16)
    with pytest.raises(TypeError, match="unexpected keyword"):
        moe(torch.randn(3, 8), k=1)  # k is not a per-call option
    with pytest.raises(dataclasses.FrozenInstanceError):
        moe.routing_options.k = 3  # type: ignore[misc]


def test_parameter_dtype_is_checked_by_name() -> None:
    """dtype given as a string (or an integer dtype) fails naming the argument, where torch.empty's own error
    names neither; a floating dtype builds parameters of that dtype."""
    from flexmoe.experts import FeedForwardExperts

    for build in (lambda d: MoELayer(8, 4, 16, dtype=d), lambda d: FeedForwardExperts(4, 8, 16, dtype=d)):
        with pytest.raises(TypeError, match=r"dtype must be a floating dtype or None, got 'bfloat16'; pass "
                                            r"torch.bfloat16"):
            build("bfloat16")
        with pytest.raises(TypeError, match="dtype must be a floating dtype or None, got 3"):
            build(3)
        with pytest.raises(TypeError, match="dtype must be a floating dtype or None, got torch.int64"):
            build(torch.int64)
        assert {p.dtype for p in build(torch.bfloat16).parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("value", [0.1, 1.25, 3, -2.5, 1e-300, 5e-324, 1.7976931348623157e308, 2.0 ** 60 + 1])
def test_constant_float_gives_back_the_same_float(value: float) -> None:
    """The options take each float through its exact integer ratio (so that torch.compile specializes a
    symbolic one): in eager it must change nothing, down to the last bit."""
    got = constant_float(value)
    assert type(got) is float and struct.pack("<d", got) == struct.pack("<d", float(value))


def test_constant_float_leaves_inf_and_nan_to_the_check() -> None:
    assert constant_float(float("inf")) == float("inf") and math.isnan(constant_float(float("nan")))
    with pytest.raises(ValueError, match="bias_update_rate must be finite"):
        RoutingOptions(balance="bias", bias_update_rate=float("inf"))
    with pytest.raises(ValueError, match="cross_node_share must be in"):
        RoutingOptions(cross_node_share=float("nan"))


def test_a_call_override_is_validated_and_changes_only_that_call() -> None:
    moe = MoELayer(8, 4, 16, k=2, capacity_factor=1.0)
    x = torch.randn(12, 8)
    moe(x, capacity=1)
    assert moe.last_plan.capacity == 1
    moe(x)
    assert moe.last_plan.capacity == 6  # ceil(2 * 1.0 * 12 / 4)
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        moe(x, capacity=-1)


@pytest.mark.parametrize("num_experts, world, builtin, want", [
    (4, 1, True, [1]),            # one process: nothing to gather from
    (4, 2, True, [0, 1]),         # whole experts
    (4, 2, False, [1]),           # a custom module's weights cannot be gathered
    (2, 4, True, [0, 1, 2]),      # s = 2 shards per expert
    (1, 4, True, [0, 1, 2, 4]),   # s = 4
    (1, 4, False, [1, 2, 4]),
])
def test_valid_r_is_one_rule_for_the_layer_and_the_cost_model(num_experts: int, world: int, builtin: bool,
                                                              want: list[int]) -> None:
    from flexmoe.parallel import ExpertLayout
    from flexmoe.tuning.cost_model import LayerConfig, valid_r

    layout = ExpertLayout(num_experts, world, 16)
    assert layout.valid_r(builtin) == want
    if builtin:  # the cost model models the built-in experts
        config = LayerConfig(tokens=8, model_dim=8, hidden_dim=16, experts=num_experts, k=1, ranks=world)
        assert valid_r(config) == want


# --------------------------------------------------------------------- docs/architecture.md against the code

def markdown_tables(text: str) -> dict[str, list[list[str]]]:
    """The body rows of every markdown table in ``text``, split into cells, keyed by the table's first header cell
    (backticks dropped); tables sharing that header cell are joined. A ``|`` inside a cell is written ``\\|``."""
    tables: dict[str, list[list[str]]] = {}
    block: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        line = line.strip()
        if line.startswith("|") and line.endswith("|") and len(line) > 1:
            block.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line[1:-1])])
            continue
        if len(block) >= 2 and set("".join(block[1])) <= set("-: "):  # a header, its rule, the rows
            tables.setdefault(block[0][0].strip("`"), []).extend(block[2:])
        block = []
    return tables


def test_markdown_tables_reads_cells_keys_and_escaped_pipes() -> None:
    text = ("intro\n| `module` | what |\n|---|---|\n| `a.b` | x \\| y |\n| `c`, `d` | z |\n\n"
            "| module | what |\n| --- | --- |\n| `e` | w |\nnot a table | here\n")
    assert markdown_tables(text) == {"module": [["`a.b`", "x \\| y"], ["`c`, `d`", "z"], ["`e`", "w"]]}


def source_modules() -> set[str]:
    """Every module and package under src/flexmoe by its dotted name (a package by its own name)."""
    names = set()
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.add(".".join(parts))
    return names


def test_the_module_map_names_every_module_and_nothing_else() -> None:
    """The module map ("Rooms": the table whose first column is ``module``) has one row naming each module and each
    package of src/flexmoe (a row may name several, each in backticks), and names nothing that is not there."""
    rows = markdown_tables(ARCHITECTURE.read_text())["module"]
    named = [name for row in rows for name in re.findall(r"`([^`]+)`", row[0])]
    assert all(row[1] for row in rows), [row for row in rows if not row[1]]  # every row says what the module is
    assert len(named) == len(set(named)), sorted({n for n in named if named.count(n) > 1})
    modules = source_modules()
    assert "flexmoe.routing.plan" in modules and "flexmoe.sharding" in modules  # the reader finds both kinds
    missing, stale = sorted(modules - set(named)), sorted(set(named) - modules)
    assert not missing, f"modules without a row in the module map of docs/architecture.md: {missing}"
    assert not stale, f"rows of the module map of docs/architecture.md naming no module: {stale}"


def documented_default(field: dataclasses.Field) -> str:
    """A field's default as the options tables write it: a string in double quotes, anything else its repr."""
    value = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
    return f'"{value}"' if isinstance(value, str) else repr(value)


@pytest.mark.parametrize("options", [RoutingOptions, ExpertOptions, ParallelOptions], ids=lambda c: c.__name__)
def test_the_options_tables_list_every_field_with_its_default(options: type) -> None:
    """Each options dataclass has a table in docs/architecture.md (first header cell: the class name) with one row
    per field: the field in backticks, its default in backticks, what it does."""
    rows = markdown_tables(ARCHITECTURE.read_text())[options.__name__]
    documented = {}
    for row in rows:
        name = re.fullmatch(r"`(\w+)`", row[0])
        assert name, f"{options.__name__} table: the first cell must be one field in backticks, got {row[0]!r}"
        assert name[1] not in documented, f"{options.__name__} table: {name[1]} has two rows"
        assert len(row) == 3 and row[2], f"{options.__name__} table: {name[1]} needs a default and a meaning"
        documented[name[1]] = row[1]
    fields = {f.name: f for f in dataclasses.fields(options)}
    missing, stale = sorted(set(fields) - set(documented)), sorted(set(documented) - set(fields))
    assert not missing, f"{options.__name__} fields without a row in docs/architecture.md: {missing}"
    assert not stale, f"rows of the {options.__name__} table naming no field: {stale}"
    wrong = {name: (cell, f"`{documented_default(fields[name])}`") for name, cell in documented.items()
             if cell != f"`{documented_default(fields[name])}`"}
    assert not wrong, f"{options.__name__} defaults in docs/architecture.md (written, true): {wrong}"


def cited_sections() -> dict[str, set[str]]:
    """Every section of docs/architecture.md that a file of the repository cites: the file's path, a comma, then
    the section's title in double quotes (several titles may follow; a citation may run over a comment's or a
    docstring's lines)."""
    cited: dict[str, set[str]] = {}
    files = [ROOT / "README.md", *[p for top in ("src", "tests", "benchmarks", "examples", "docs", "scripts")
                                   for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".md", ".sh")]]
    for path in files:
        if path == ARCHITECTURE:
            continue
        flat = re.sub(r"\n\s*(?:#\s*)?", " ", path.read_text())  # a comment's or docstring's lines joined
        for match in re.finditer(r'docs/architecture\.md,?\s*((?:"[^"]+"(?:,\s*|\s+)?)+)', flat):
            for title in re.findall(r'"([^"]+)"', match[1]):
                cited.setdefault(" ".join(title.split()), set()).add(str(path.relative_to(ROOT)))
    return cited


def test_every_section_the_code_cites_is_a_heading() -> None:
    cited = cited_sections()
    assert {"The routing contract", "Models larger than one rank", "Expert compute"} <= set(cited)  # the reader
    headings = {line.lstrip("#").strip() for line in ARCHITECTURE.read_text().splitlines() if line.startswith("#")}
    missing = {title: sorted(files) for title, files in cited.items() if title not in headings}
    assert not missing, f"sections cited but not headings of docs/architecture.md: {missing}"


def heading_anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))])
def test_the_docs_links_resolve(doc: str) -> None:
    """Every relative link of README.md and docs/*.md names a file that is there, and an anchor a heading in it."""
    path = ROOT / doc
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s) and the like: not checked here
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md":
            anchors = {heading_anchor(line.lstrip("#")) for line in linked.read_text().splitlines()
                       if line.startswith("#")}
            if anchor not in anchors:
                broken.append(target)
    assert not broken, f"{doc}: links that do not resolve: {broken}"


# ------------------------------------------------------------------------- the README's first example, as written

def readme_layer_example() -> tuple[int, str]:
    """The README's first Python block: the line its code starts on, and its code."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("```python") + 1
    return start + 1, "\n".join(lines[start:lines.index("```", start)])


def test_the_readme_example_runs_and_reports_what_a_dense_reference_computes(capsys) -> None:
    """The layer's example opens the README (its code within the first 40 lines), runs as written, and its numbers
    are those of a plain dense computation of the same router and experts: top-2 of the softmax (ties to the lower
    expert), each expert keeping its first C pairs (1st choices before 2nd, token order), the normalized weights,
    GELU experts, Switch's balance loss and the z-loss."""
    first_line, code = readme_layer_example()
    assert first_line <= 40, f"the README's layer example starts at line {first_line}"
    torch.manual_seed(0)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    moe, x, y, plan = scope["moe"], scope["x"], scope["y"], scope["plan"]
    printed = capsys.readouterr().out.splitlines()

    with torch.no_grad():
        tokens = x.reshape(-1, 512).double()
        num_tokens, num_experts, k = tokens.shape[0], 8, 2
        capacity = math.ceil(k * 1.25 * num_tokens / num_experts)
        logits = tokens @ moe.router.weight.double().T
        probs = logits.softmax(-1)
        choice = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]  # [T, k]
        kept = torch.zeros(num_tokens, k, dtype=torch.bool)
        used = [0] * num_experts
        for c in range(k):
            for e in range(num_experts):
                rows = (choice[:, c] == e).nonzero().flatten()[:max(capacity - used[e], 0)]
                kept[rows, c] = True
                used[e] += len(rows)
        weights = probs.gather(1, choice)
        weights = weights / weights.sum(-1, keepdim=True)
        experts = moe.experts
        want = torch.zeros_like(tokens)
        for e in range(num_experts):
            hidden = torch.nn.functional.gelu(tokens @ experts.w1[e].double() + experts.b1[e].double())
            out = hidden @ experts.w2[e].double() + experts.b2[e].double()
            for c in range(k):
                pick = kept[:, c] & (choice[:, c] == e)
                want[pick] += weights[pick, c, None] * out[pick]
        first_share = torch.bincount(choice[:, 0], minlength=num_experts).double() / num_tokens
        aux = num_experts * (first_share * probs.mean(0)).sum()
        z = torch.logsumexp(logits, -1).square().mean()

    assert y.shape == x.shape == (4, 1024, 512)
    assert printed[0] == str(capacity) == "1280"
    assert plan.tokens_per_expert.tolist() == used
    assert math.isclose(float(plan.dropped_fraction), 1 - kept.double().mean().item(), abs_tol=1e-12)
    torch.testing.assert_close(y.reshape(-1, 512).double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(moe.aux_loss.double(), aux, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(moe.z_loss.double(), z, rtol=1e-5, atol=1e-7)
    assert moe.router.weight.grad is not None and moe.experts.w1.grad is not None  # loss.backward() reached both


def test_the_design_document_stays_short_enough_to_read() -> None:
    """docs/architecture.md describes the design in at most 600 lines (issue 40); measurements and histories go
    to docs/performance.md."""
    lines = (SRC.parents[1] / "docs" / "architecture.md").read_text().splitlines()
    assert len(lines) <= 600, f"docs/architecture.md has {len(lines)} lines; move detail to docs/performance.md"
