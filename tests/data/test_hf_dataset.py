"""The `hf_dataset` prompt source on local `datasets` folders (one written by `save_to_disk`, one of parquet files):
items, images, metadata, row limits, and errors that name the column or split and the fix."""

import pytest
from PIL import Image

from mmgrpo import registry
from mmgrpo.protocols import PromptSource

datasets = pytest.importorskip("datasets", reason="the optional `datasets` extra (installed by .[test])")


def _rows(n, offset=0):
    return {
        "problem": [f"How many circles are in picture {i + offset}?" for i in range(n)],
        "answer": [str(i + offset) for i in range(n)],
        "image": [Image.new("RGB", (20 + i, 10), (10 * i, 0, 0)) for i in range(n)],
        "boxes": [[[1, 1, 5, 5]] for _ in range(n)],
        "source": ["synthetic"] * n,
    }


@pytest.fixture(scope="module")
def saved_dict(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    features = datasets.Features({"problem": datasets.Value("string"), "answer": datasets.Value("string"),
                                  "image": datasets.Image(), "boxes": datasets.Sequence(datasets.Sequence(datasets.Value("int32"))),
                                  "source": datasets.Value("string")})
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict(_rows(5), features=features),
        "test": datasets.Dataset.from_dict(_rows(3, offset=100), features=features),
    }).save_to_disk(str(folder))
    return str(folder)


def _source(**options):
    cls = registry.get("data", "hf_dataset")
    return cls(cls.Config(**options))


def test_items_from_a_saved_dataset_dict(saved_dict):
    source = _source(path=saved_dict, eval_split="test", image_column="image", prompt_template="Q: {question}",
                     max_train_rows=4)
    assert isinstance(source, PromptSource) and source.disjoint_splits is False
    train, held_out = source.train_items(), source.eval_items()
    assert len(train) == 4 and len(held_out) == 3
    first = train[1]
    assert first["prompt"] == "Q: How many circles are in picture 1?"
    assert first["metadata"] == {"answer": "1", "boxes": [[1, 1, 5, 5]], "source": "synthetic", "image_size": [21, 10]}
    assert len(first["images"]) == 1 and first["images"][0].mode == "RGB" and first["images"][0].size == (21, 10)
    assert first["images"][0].getpixel((0, 0)) == (10, 0, 0)
    assert held_out[0]["metadata"]["answer"] == "100"


def test_chosen_metadata_columns_and_a_folder_of_data_files(tmp_path):
    datasets.Dataset.from_dict({"question": ["1 + 1?", "2 + 2?"], "solution": ["2", "4"], "extra": ["x", "y"]}
                               ).to_parquet(str(tmp_path / "train.parquet"))
    source = _source(path=str(tmp_path), question_column="question", metadata_columns=["solution"])
    assert [(i["prompt"], i["metadata"], i["images"]) for i in source.train_items()] == [
        ("1 + 1?", {"solution": "2"}, []), ("2 + 2?", {"solution": "4"}, [])]
    assert source.eval_items() == []


def test_errors_name_the_problem_and_the_fix(saved_dict, tmp_path):
    with pytest.raises(ValueError, match="has no column 'question'.*set data.question_column"):
        _source(path=saved_dict, question_column="question").train_items()
    with pytest.raises(ValueError, match=r"has no split 'validation'; it has \['test', 'train'\]"):
        _source(path=saved_dict, eval_split="validation").eval_items()
    with pytest.raises(ValueError, match=r"has no column\(s\) \['label'\]"):
        _source(path=saved_dict, metadata_columns=["label"]).train_items()
    with pytest.raises(ValueError, match="data.path: dataset folder .* does not exist.*save_to_disk"):
        _source(path=str(tmp_path / "missing"))  # checked when the config is built, before anything loads
    with pytest.raises(ValueError, match="must contain '{question}'"):
        _source(path=saved_dict, prompt_template="no placeholder")
