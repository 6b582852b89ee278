"""The arr-coc/1 schema declaration: the README's schema block matches it; rows are checked by it."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from sinks.schema import (ANSWERS, DIMS, FORMAT, FRAMES, GAPS, ROOT_ATTRS, STREAM_ATTRS, TABLES, Field, answer_row,
                          gap_row)

README = Path(__file__).resolve().parents[2] / "README.md"
# every numpy dtype name a schema line could use, declared or not: an undeclared one is caught too
ARRAY = re.compile(r"\b([a-z_]\w*)\s+(float16|float32|float64|int8|int16|int32|int64|uint8|uint16|uint32|uint64"
                   r"|bool|str)\s+\[([^\]]*)\]")


def schema_block() -> list[str]:
    text = README.read_text()
    section = text.split("\n## Output schema", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1].splitlines()


def readme_schema() -> tuple[dict[str, dict[str, tuple[str, tuple[str, ...]]]], set[str], set[str]]:
    """{table group: {array: (dtype, dims as written)}}, root attr names, stream attr names."""
    tables: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {t.group: {} for t in TABLES}
    root_attrs, stream_attrs = set(), set()
    group, in_attrs = "", False
    for line in schema_block():
        stripped = line.strip()
        if stripped.startswith("attrs: {"):                                 # the root's: "attrs: {"format": ...}"
            root_attrs |= set(re.findall(r'"(\w+)":', stripped))
            continue
        if stripped.startswith("attrs:"):
            in_attrs = True
            stripped = stripped[len("attrs:"):]
        elif ARRAY.search(line) or stripped.endswith("/") or re.match(r"\w+/\s", stripped):
            in_attrs = False
        if in_attrs:
            without = re.sub(r"\([^)]*\)|\[[^\]]*\]", "", stripped)       # "(bool)", "[gh, gw]"
            stream_attrs |= {name.strip() for name in without.split(",") if name.strip()}
            continue
        heading = re.match(r"(\w+)/(\s|$)", stripped)
        if heading:
            group = heading.group(1)
            assert group in tables, f"README schema names an undeclared group {group}/"
        for name, dtype, dims in ARRAY.findall(line):
            tables[group][name] = (dtype, tuple(d.strip() for d in dims.split(",")))
    return tables, root_attrs, stream_attrs


class TestReadme:
    def test_every_declared_array_and_nothing_else_with_its_dtype_and_dims(self):
        tables, _, _ = readme_schema()
        for table in TABLES:
            want = {f.name: (f.dtype, tuple(DIMS[d] for d in f.dims)) for f in table.fields}
            assert tables[table.group] == want, table.group or "frame arrays"

    def test_every_declared_attr_and_nothing_else(self):
        _, root_attrs, stream_attrs = readme_schema()
        assert root_attrs == {a.name for a in ROOT_ATTRS}
        assert stream_attrs == {a.name for a in STREAM_ATTRS}
        assert f'"format": "{FORMAT}"' in "\n".join(schema_block())

    def test_the_parser_sees_a_missing_or_undeclared_line(self, monkeypatch):
        lines = schema_block()
        monkeypatch.setattr(f"{__name__}.schema_block",
                            lambda: [ln for ln in lines if "passes" not in ln] + ["      extra uint32 [A]  undeclared"])
        tables, _, _ = readme_schema()
        assert "passes" not in tables["answers"] and tables["gaps"]["extra"] == ("uint32", ("A",))


class TestDeclaration:
    def test_tables_are_well_formed(self):
        for table in TABLES:
            names = table.names
            assert len(set(names)) == len(names)
            for f in table.fields:
                assert f.dims[0] == table.dim and f.meaning
                if f.default_from is not None:                               # filled from an earlier field
                    assert names.index(f.default_from) < names.index(f.name)
        assert [t.group for t in TABLES] == ["", "answers", "gaps"] and GAPS.optional and not ANSWERS.optional
        assert {f.name for f in ANSWERS.fields if f.added} == {"passes", "tokens_spent", "confidence", "no_answer"}
        assert FRAMES.field("relevance").dims == ("frame", "y", "x")

    def test_bad_declarations_are_refused(self):
        with pytest.raises(ValueError, match=r"invalid dtype \('float8'\)"):
            Field("x", "float8", ("frame",), "?")
        with pytest.raises(ValueError, match=r"invalid dims \['time'\]"):
            Field("x", "float32", ("time",), "?")


class TestRows:
    GOOD = dict(t_start=0.0, t_end=2.0, question="q?", text="a", tokens_kept=12, tokens_full=300, latency_s=0.5)

    def test_answer_defaults_and_order(self):
        row = answer_row({**self.GOOD})
        assert list(row) == list(ANSWERS.names) and row["passes"] == 1 and row["tokens_spent"] == 12
        row = answer_row({**self.GOOD, "passes": np.uint8(3), "tokens_spent": 40})
        assert (row["passes"], row["tokens_spent"]) == (3, 40)

    @pytest.mark.parametrize("change, message", [
        (dict(t_end=float("inf")), "t_end must be a finite number, got inf"),
        (dict(t_start=True), "t_start must be a finite number, got True"),
        (dict(text=None), "answer field 'text' is missing"),
        (dict(question=3), "question must be a string, got int"),
        (dict(tokens_kept=2**31), r"tokens_kept must be an int in \[0, 2147483647\], got 2147483648"),
        (dict(tokens_full=1.0), r"tokens_full must be an int in \[0, 2147483647\], got 1.0"),
        (dict(passes=0), r"passes must be an int in \[1, 255\], got 0"),
        (dict(tokens_spent=11), r"tokens_spent \(11\) counts every pass"),
        (dict(tokenz=1), r"unknown answer field\(s\) 'tokenz'"),
    ])
    def test_bad_answers_name_the_field_and_the_allowed_values(self, change, message):
        with pytest.raises(ValueError, match=message):
            answer_row({**self.GOOD, **change})

    def test_gap_rows(self):
        good = dict(start_pts=1.0, end_pts=2.0, start_wall=10.0, end_wall=11.0, reason="timeout")
        assert gap_row(good) == good
        with pytest.raises(ValueError, match="a gap must end after it starts"):
            gap_row({**good, "end_wall": 9.0})

    def test_frame_columns_are_checked_and_cast(self):
        relevance = FRAMES.field("relevance").check_column(np.array([[-0.5, 1.5]]))
        assert relevance.dtype == np.float16 and relevance.tolist() == [[0.0, 1.0]]
        with pytest.raises(ValueError, match=r"tokens must be integers in \[0, 65535\], got dtype int64 range \[0, 7"):
            FRAMES.field("tokens").check_column(np.array([0, 70000]))
        with pytest.raises(ValueError, match="frame_index must be integers .* got dtype float64"):
            FRAMES.field("frame_index").check_column(np.array([1.0]))
        with pytest.raises(ValueError, match="motion contains NaN or inf"):
            FRAMES.field("motion").check_column(np.array([np.nan]))

    def test_defaults_for_stores_written_before_a_field(self):
        columns = {"tokens_kept": np.int32([4, 9])}
        np.testing.assert_array_equal(ANSWERS.field("tokens_spent").default_column(columns, 2), [4, 9])
        passes = ANSWERS.field("passes").default_column(columns, 2)
        assert passes.dtype == np.uint8 and passes.tolist() == [1, 1]
