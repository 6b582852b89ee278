"""MSR-VTT readers on generated fixtures in the real layouts, and every malformed input they must name."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from evaluation.fixtures import write_fixture
from sources import SourceError
from sources.msrvtt import Question, load_msrvtt, load_msrvtt_captions, load_msrvtt_qa, stream_id_of


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, list[Question]]:
    root = tmp_path_factory.mktemp("msrvtt_release")
    return root, write_fixture(root, videos=3, questions_per_video=3, height=32, width=48, seconds=0.4)


class TestRelease:
    def test_questions_grouped_by_video_in_number_order(self, release):
        root, written = release
        ds = load_msrvtt_qa(root, "test")
        assert ds.layout == "msrvtt-qa" and ds.annotation == root / "test_qa.json"
        assert ds.videos_dir == root / "videos" / "all"
        videos = ds.videos()
        assert [v.video_id for v in videos] == ["video7010", "video7011", "video7012"]
        assert all(len(v.questions) == 3 and v.path == root / "videos/all" / f"{v.video_id}.mp4" for v in videos)
        assert sorted(ds.questions, key=lambda q: q.question_id) == sorted(written, key=lambda q: q.question_id)

    def test_release_fields_map_to_questions(self, release):
        root, _ = release
        raw = json.loads((root / "test_qa.json").read_text())[0]
        assert isinstance(raw["id"], int) and isinstance(raw["video_id"], int)
        q = load_msrvtt_qa(root).by_id()[str(raw["id"])]
        assert q.video_id == f"video{raw['video_id']}" and q.question == raw["question"]
        assert q.answer == raw["answer"] and q.type == ("what", "who", "how", "when", "where")[raw["category_id"]]

    def test_unique_renders_that_many_clips_and_reuses_them(self, tmp_path, monkeypatch):
        import sources.synthetic as synthetic
        rendered = []
        real = synthetic.render_clip
        monkeypatch.setattr(synthetic, "render_clip", lambda *a, **k: rendered.append(1) or real(*a, **k))
        written = write_fixture(tmp_path, videos=5, questions_per_video=2, height=32, width=48, seconds=0.4, unique=2)
        assert len(rendered) == 2                                   # clips 0 and 1; the rest reuse them
        videos = load_msrvtt(tmp_path).videos()
        assert [v.video_id for v in videos] == [f"video{7010 + i}" for i in range(5)]
        data = {v.video_id: v.path.read_bytes() for v in videos}
        assert data["video7012"] == data["video7014"] == data["video7010"] and data["video7013"] == data["video7011"]
        assert data["video7010"] != data["video7011"]
        assert len(written) == 10 and len({q.question_id for q in written}) == 10   # each video its own questions
        # written again over the same root (a link already there is replaced)
        write_fixture(tmp_path, videos=5, questions_per_video=2, height=32, width=48, seconds=0.4, unique=2)
        assert (tmp_path / "videos/all/video7014.mp4").read_bytes() == data["video7010"]
        with pytest.raises(ValueError, match="unique"):
            write_fixture(tmp_path, videos=2, unique=0)

    def test_missing_video_has_no_path(self, tmp_path):
        write_fixture(tmp_path, videos=2, questions_per_video=1, height=32, width=48, seconds=0.4)
        (tmp_path / "videos/all/video7011.mp4").unlink()
        paths = {v.video_id: v.path for v in load_msrvtt(tmp_path).videos()}
        assert paths["video7010"] is not None and paths["video7011"] is None

    def test_explicit_videos_dir(self, release, tmp_path):
        root, _ = release
        assert load_msrvtt(root, videos_dir=root / "videos/all").videos_dir == root / "videos/all"
        with pytest.raises(SourceError, match="not a directory"):
            load_msrvtt(root, videos_dir=tmp_path / "nope")


class TestZeroShot:
    def test_questions_joined_with_answers_by_id(self, tmp_path):
        written = write_fixture(tmp_path, layout="zero-shot", videos=2, questions_per_video=2, height=32,
                                width=48, seconds=0.4)
        # the answers file in another order: the join is by question_id, not position
        answers = json.loads((tmp_path / "test_a.json").read_text())[::-1]
        (tmp_path / "test_a.json").write_text(json.dumps(answers))
        ds = load_msrvtt(tmp_path)
        assert ds.layout == "zero-shot"
        assert {q.question_id: (q.answer, q.type) for q in ds.questions} == \
               {q.question_id: (q.answer, q.type) for q in written}
        assert ds.by_id()["v_video7011_1"].video_id == "video7011"

    def test_missing_answers_file_is_named(self, tmp_path):
        write_fixture(tmp_path, layout="zero-shot", videos=1, questions_per_video=1, height=32, width=48, seconds=0.4)
        (tmp_path / "test_a.json").unlink()
        with pytest.raises(SourceError, match=r"test_a\.json"):
            load_msrvtt(tmp_path)

    def test_question_without_answer_is_named(self, tmp_path):
        write_fixture(tmp_path, layout="zero-shot", videos=1, questions_per_video=2, height=32, width=48, seconds=0.4)
        answers = json.loads((tmp_path / "test_a.json").read_text())
        answers[1]["question_id"] = "v_other"
        (tmp_path / "test_a.json").write_text(json.dumps(answers))
        with pytest.raises(SourceError, match=r"no answer for question_id v_video7010_1"):
            load_msrvtt(tmp_path)


class TestCaptions:
    def test_videodatainfo_split_and_captions(self, tmp_path):
        write_fixture(tmp_path, layout="captions", videos=2, height=32, width=48, seconds=0.4)
        videos = load_msrvtt_captions(tmp_path, "test")
        assert [v.video_id for v in videos] == ["video7010", "video7011"]
        assert all(len(v.captions) == 3 for v in videos)
        assert load_msrvtt_captions(tmp_path, "train") == []  # every fixture video is in "test"
        ds = load_msrvtt(tmp_path, task="caption")
        assert ds.layout == "captions" and len(ds.questions) == 2
        assert ds.questions[0].answer == videos[0].captions[0] and ds.questions[0].references == videos[0].captions[1:]

    def test_wrong_shape_is_named(self, tmp_path):
        (tmp_path / "videodatainfo.json").write_text(json.dumps({"videos": {}}))
        with pytest.raises(SourceError, match="videodatainfo.json must be an object with 'videos' and 'sentences'"):
            load_msrvtt_captions(tmp_path)


class TestBadInput:
    def test_unknown_split(self, release):
        with pytest.raises(SourceError, match=r"unknown split 'dev'; allowed: train, val, test"):
            load_msrvtt(release[0], "dev")

    def test_split_without_annotations_names_both_layouts(self, release):
        with pytest.raises(SourceError, match=r"train_qa\.json .*train_q\.json \+ train_a\.json"):
            load_msrvtt(release[0], "train")

    def test_malformed_json_names_file_and_position(self, tmp_path):
        (tmp_path / "test_qa.json").write_text('[{"answer": "x", ')
        with pytest.raises(SourceError, match=r"test_qa\.json is not valid JSON: .* line 1 column"):
            load_msrvtt(tmp_path)

    def test_record_missing_keys(self, tmp_path):
        (tmp_path / "test_qa.json").write_text(json.dumps([{"answer": "x", "question": "q?", "video_id": 1}]))
        with pytest.raises(SourceError, match=r"test_qa\.json: record 0 lacks category_id, id"):
            load_msrvtt(tmp_path)

    def test_not_a_list(self, tmp_path):
        (tmp_path / "test_qa.json").write_text(json.dumps({"questions": []}))
        with pytest.raises(SourceError, match="must hold a JSON list"):
            load_msrvtt(tmp_path)

    def test_duplicate_question_id(self, tmp_path):
        rec = {"answer": "x", "category_id": 0, "id": 5, "question": "what?", "video_id": 7010}
        (tmp_path / "test_qa.json").write_text(json.dumps([rec, rec]))
        with pytest.raises(SourceError, match="question id 5 appears more than once"):
            load_msrvtt(tmp_path)

    @pytest.mark.parametrize("layout", ["msrvtt-qa", "zero-shot"])
    def test_question_that_is_not_text_is_skipped_with_one_warning(self, tmp_path, layout):
        written = write_fixture(tmp_path, layout=layout, videos=2, questions_per_video=2, height=32, width=48,
                                seconds=0.4)
        path = tmp_path / ("test_qa.json" if layout == "msrvtt-qa" else "test_q.json")
        records = json.loads(path.read_text())
        records[1]["question"], records[3]["question"] = None, 42
        path.write_text(json.dumps(records))
        id_key = "id" if layout == "msrvtt-qa" else "question_id"
        bad = [str(records[1][id_key]), str(records[3][id_key])]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ds = load_msrvtt(tmp_path)
        assert len(caught) == 1
        message = str(caught[0].message)
        assert str(path) in message and "skipped 2 question(s)" in message
        assert f"{bad[0]} (null)" in message and f"{bad[1]} (int)" in message
        assert list(ds.skipped) == bad
        assert sorted(q.question_id for q in ds.questions) == sorted(q.question_id for q in written
                                                                     if q.question_id not in bad)
        assert all(q.question not in ("None", "42") for q in ds.questions)

    def test_missing_root_and_unknown_task(self, tmp_path):
        with pytest.raises(SourceError, match="is not a directory"):
            load_msrvtt(tmp_path / "nope")
        with pytest.raises(SourceError, match="unknown task 'vqa'"):
            load_msrvtt(tmp_path, task="vqa")


@pytest.mark.parametrize("raw, want", [(7010, "video7010"), ("video12", "video12"), ("12", "video12"),
                                       ("video12.mp4", "video12")])
def test_stream_id_of(raw, want):
    assert stream_id_of(raw) == want
