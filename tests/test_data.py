"""The data modules: splits, transforms, missing-data messages, and a tiny Lightning fit with each.

CIFAR-10 and ImageNet are replaced by tiny datasets of the real formats written under ``tmp_path``;
nothing is downloaded.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from sklearn.datasets import load_digits
from torch import nn

from lightning_pipe.errors import PlanningError
from lightning_pipe.zoo.data import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    DATA_MODULES,
    CIFAR10DataModule,
    DigitsDataModule,
    ImageNetDataModule,
    SyntheticDataModule,
    split_indices,
)

# ---------------------------------------------------------------------------------------------- digits


def _batches(loader: torch.utils.data.DataLoader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.clone(), y.clone()) for x, y in loader]


def test_digits_splits_are_disjoint_complete_and_match_sklearn() -> None:
    dm = DigitsDataModule()
    assert (dm.num_classes, dm.input_shape) == (10, (1, 8, 8))
    dm.setup("fit")
    train, val, test = dm.indices["train"], dm.indices["val"], dm.indices["test"]
    assert len(train) + len(val) + len(test) == 1797
    assert (len(val), len(test)) == (round(0.15 * 1797), round(0.15 * 1797))
    assert torch.equal(torch.cat([train, val, test]).sort().values, torch.arange(1797))
    assert [len(dm.train_dataset), len(dm.val_dataset), len(dm.test_dataset)] == [len(train), len(val), len(test)]
    digits = load_digits()
    for name, dataset in [("train", dm.train_dataset), ("val", dm.val_dataset), ("test", dm.test_dataset)]:
        images, labels = dataset.tensors
        expected = (
            torch.as_tensor(digits.images[dm.indices[name].numpy()], dtype=torch.float32) / 16 - dm.mean
        ) / dm.std
        torch.testing.assert_close(images[:, 0], expected)
        assert torch.equal(labels, torch.as_tensor(digits.target[dm.indices[name].numpy()]))


def test_digits_same_seed_same_split_and_order_other_seed_differs() -> None:
    first, again, other = DigitsDataModule(seed=7), DigitsDataModule(seed=7), DigitsDataModule(seed=8)
    for dm in (first, again, other):
        dm.setup("fit")
    assert all(torch.equal(first.indices[k], again.indices[k]) for k in ("train", "val", "test"))
    assert not torch.equal(first.indices["val"], other.indices["val"])
    order, order_again, order_other = (_batches(dm.train_dataloader()) for dm in (first, again, other))
    assert all(torch.equal(a[1], b[1]) and torch.equal(a[0], b[0]) for a, b in zip(order, order_again, strict=True))
    assert not torch.equal(torch.cat([y for _, y in order]), torch.cat([y for _, y in order_other]))
    # a second epoch of the same loader is shuffled differently, and identically across processes
    loader, loader_again = first.train_dataloader(), again.train_dataloader()
    epoch_1, epoch_2 = _batches(loader), _batches(loader)
    assert not torch.equal(torch.cat([y for _, y in epoch_1]), torch.cat([y for _, y in epoch_2]))
    again_epochs = [_batches(loader_again) for _epoch in range(2)]
    assert torch.equal(torch.cat([y for _, y in epoch_2]), torch.cat([y for _, y in again_epochs[1]]))


def test_digits_batches_and_normalisation() -> None:
    dm = DigitsDataModule(batch_size=32)
    for loader in (dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader(), dm.predict_dataloader()):
        x, y = next(iter(loader))
        assert x.shape == (32, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
        assert int(y.min()) >= 0 and int(y.max()) <= 9
    images = dm.train_dataset.tensors[0]
    assert abs(images.mean().item()) < 1e-5 and abs(images.std().item() - 1) < 1e-5
    raw = torch.as_tensor(load_digits().images[dm.indices["train"].numpy()], dtype=torch.float32) / 16
    assert dm.mean == pytest.approx(raw.mean().item(), rel=1e-5)
    assert dm.std == pytest.approx(raw.std().item(), rel=1e-5)
    # the other splits use the training statistics, not their own
    val = dm.val_dataset.tensors[0] * dm.std + dm.mean
    raw_val = torch.as_tensor(load_digits().images[dm.indices["val"].numpy()], dtype=torch.float32) / 16
    torch.testing.assert_close(val[:, 0], raw_val)


def test_digits_as_rgb_repeat_the_grey_channel() -> None:
    """``channels=3`` (the torchvision models' input): the same normalised image in every channel."""
    grey, rgb = DigitsDataModule(seed=3), DigitsDataModule(seed=3, channels=3)
    assert rgb.input_shape == (3, 8, 8)
    grey.setup(), rgb.setup()
    images, labels = rgb.train_dataset.tensors
    assert images.shape[1:] == (3, 8, 8) and torch.equal(labels, grey.train_dataset.tensors[1])
    for channel in range(3):
        assert torch.equal(images[:, channel], grey.train_dataset.tensors[0][:, 0])
    with pytest.raises(PlanningError, match=r"channels must be 1 .* or 3"):
        DigitsDataModule(channels=2)


@settings(max_examples=25, deadline=None)
@given(
    val_fraction=st.floats(0.01, 0.45),
    test_fraction=st.floats(0.01, 0.45),
    seed=st.integers(0, 2**31),
)
def test_digits_split_is_disjoint_and_complete_for_any_fractions(
    val_fraction: float, test_fraction: float, seed: int
) -> None:
    dm = DigitsDataModule(val_fraction=val_fraction, test_fraction=test_fraction, seed=seed)
    dm.setup()
    parts = [dm.indices[k] for k in ("train", "val", "test")]
    assert [len(p) for p in parts[1:]] == [round(val_fraction * 1797), round(test_fraction * 1797)]
    assert all(len(p) >= 1 for p in parts)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(1797))


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(3, 500),
    val_fraction=st.floats(0.0, 1.0, exclude_min=True, exclude_max=True),
    test_fraction=st.floats(0.0, 1.0, exclude_min=True, exclude_max=True),
    seed=st.integers(0, 2**63 - 1),
)
def test_split_indices_partitions_or_refuses(n: int, val_fraction: float, test_fraction: float, seed: int) -> None:
    sizes = [n - round(val_fraction * n) - round(test_fraction * n), round(val_fraction * n), round(test_fraction * n)]
    if val_fraction + test_fraction >= 1 or min(sizes) < 1:
        with pytest.raises(PlanningError, match="fraction"):
            split_indices(n, val_fraction, test_fraction, seed)
        return
    parts = split_indices(n, val_fraction, test_fraction, seed)
    assert [len(p) for p in parts] == sizes
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(n))
    assert all(
        torch.equal(a, b) for a, b in zip(parts, split_indices(n, val_fraction, test_fraction, seed), strict=True)
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size must be a whole number of images >= 1; got 0"),
        ({"val_fraction": 0.0}, "val_fraction must be a fraction strictly between 0 and 1"),
        ({"test_fraction": 1.5}, "test_fraction must be a fraction strictly between 0 and 1"),
        ({"val_fraction": 0.6, "test_fraction": 0.4}, "val_fraction \\+ test_fraction must be < 1"),
        ({"val_fraction": 1e-5}, "leave no validation item out of 1797"),
        ({"seed": -1}, "seed must be a whole number >= 0"),
        ({"num_workers": -1}, "num_workers must be a whole number"),
    ],
)
def test_digits_refuses_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PlanningError, match=message):
        DigitsDataModule(**kwargs)


# ---------------------------------------------------------------------------------------------- CIFAR-10


class _Py2Str(bytes):
    """Bytes pickled as a Python 2 ``str``, as in the official CIFAR-10 files."""


class _Py2Pickler(pickle._Pickler):
    """Writes :class:`_Py2Str` with the Python 2 string opcode: loading with ``encoding="latin1"`` (as
    torchvision does) gives ``str`` keys, with ``encoding="bytes"`` ``b"data"`` keys, like the real files."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_py2_str(self, obj: _Py2Str) -> None:
        data = bytes(obj)
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + len(data).to_bytes(4, "little") + data)
        self.memoize(obj)

    dispatch[_Py2Str] = _save_py2_str


def _write_py2_pickle(path: Path, content: dict[str, object]) -> None:
    def py2(value: object) -> object:
        if isinstance(value, str):
            return _Py2Str(value.encode("latin1"))
        if isinstance(value, list):
            return [py2(item) for item in value]
        return value

    buffer = io.BytesIO()
    _Py2Pickler(buffer, protocol=2).dump({py2(key): py2(value) for key, value in content.items()})
    path.write_bytes(buffer.getvalue())


CIFAR_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def write_cifar10(root: Path, per_batch: int = 4, test: int = 6, seed: int = 0) -> dict[str, np.ndarray]:
    """A tiny CIFAR-10 (python version) under ``root``; returns the pixels (N x 3072) and labels written."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    written: dict[str, list[np.ndarray]] = {"train": [], "train_labels": []}
    for number in range(1, 6):
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, per_batch).tolist()
        _write_py2_pickle(
            folder / f"data_batch_{number}",
            {
                "batch_label": f"training batch {number} of 5",
                "labels": labels,
                "data": data,
                "filenames": [f"image_{number}_{i}.png" for i in range(per_batch)],
            },
        )
        written["train"].append(data)
        written["train_labels"].append(np.array(labels))
    test_data = rng.integers(0, 256, (test, 3072), dtype=np.uint8)
    test_labels = rng.integers(0, 10, test).tolist()
    _write_py2_pickle(
        folder / "test_batch",
        {
            "batch_label": "testing batch 1 of 1",
            "labels": test_labels,
            "data": test_data,
            "filenames": ["t.png"] * test,
        },
    )
    _write_py2_pickle(folder / "batches.meta", {"label_names": CIFAR_NAMES, "num_cases_per_batch": per_batch})
    return {
        "train": np.concatenate(written["train"]),
        "train_labels": np.concatenate(written["train_labels"]),
        "test": test_data,
        "test_labels": np.array(test_labels),
    }


def _cifar_pixels(image: torch.Tensor) -> np.ndarray:
    """Undo the normalisation: the uint8 pixels as a flat row-major CHW row, like the files."""
    mean, std = torch.tensor(CIFAR10_MEAN).view(3, 1, 1), torch.tensor(CIFAR10_STD).view(3, 1, 1)
    return (image * std + mean).mul(255).round().to(torch.uint8).numpy().reshape(3072)


def test_tiny_cifar10_files_have_the_official_format(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_1", "rb") as file:
        entry = pickle.load(file, encoding="bytes")  # as the CIFAR-10 page's own unpickle() reads them
    assert {b"data", b"labels", b"batch_label", b"filenames"} <= entry.keys()
    assert entry[b"data"].dtype == np.uint8 and entry[b"data"].shape == (4, 3072)
    with open(tmp_path / "cifar-10-batches-py" / "batches.meta", "rb") as file:
        assert pickle.load(file, encoding="bytes")[b"label_names"][0] == b"airplane"


def test_cifar10_reads_the_pixels_and_labels_written(tmp_path: Path) -> None:
    written = write_cifar10(tmp_path)
    dm = CIFAR10DataModule(str(tmp_path), batch_size=5, num_workers=0, augment=False, verify_md5=False)
    dm.setup("fit")
    assert len(dm.train_dataset) == 20 and len(dm.test_dataset) == 6 and dm.val_dataset is dm.test_dataset
    for i in range(20):
        image, label = dm.train_dataset[i]
        assert image.shape == (3, 32, 32) and image.dtype == torch.float32
        np.testing.assert_array_equal(_cifar_pixels(image), written["train"][i])
        assert label == written["train_labels"][i]
    for i in range(6):
        image, label = dm.test_dataset[i]
        np.testing.assert_array_equal(_cifar_pixels(image), written["test"][i])
        assert label == written["test_labels"][i]
    x, y = next(iter(dm.test_dataloader()))
    assert x.shape == (5, 3, 32, 32) and torch.equal(y, torch.as_tensor(written["test_labels"][:5]))


def test_cifar10_val_size_holds_out_the_last_training_images_unaugmented(tmp_path: Path) -> None:
    written = write_cifar10(tmp_path)
    dm = CIFAR10DataModule(tmp_path, num_workers=0, augment=True, val_size=3, verify_md5=False)
    dm.setup("fit")
    assert (len(dm.train_dataset), len(dm.val_dataset), len(dm.test_dataset)) == (17, 3, 6)
    for i in range(3):
        image, label = dm.val_dataset[i]
        np.testing.assert_array_equal(_cifar_pixels(image), written["train"][17 + i])
        assert label == written["train_labels"][17 + i]
    with pytest.raises(PlanningError, match="val_size=20 holds out every training image"):
        CIFAR10DataModule(tmp_path, val_size=20, verify_md5=False).setup("fit")


def test_cifar10_augmentation_crops_flips_and_varies(tmp_path: Path) -> None:
    written = write_cifar10(tmp_path)
    dm = CIFAR10DataModule(tmp_path, num_workers=0, augment=True, verify_md5=False)
    dm.setup("fit")
    torch.manual_seed(0)
    epochs = [[dm.train_dataset[i][0] for i in range(20)] for _ in range(2)]
    assert all(image.shape == (3, 32, 32) for epoch in epochs for image in epoch)
    assert any(not torch.equal(a, b) for a, b in zip(*epochs, strict=True))
    # each augmented image is a 32x32 window of the image padded by 4 zeros, maybe mirrored
    padded = np.pad(written["train"][0].reshape(3, 32, 32), ((0, 0), (4, 4), (4, 4)))
    windows = [padded[:, top : top + 32, left : left + 32] for top in range(9) for left in range(9)]
    pixels = _cifar_pixels(epochs[0][0]).reshape(3, 32, 32)
    assert any(np.array_equal(pixels, w) or np.array_equal(pixels, w[:, :, ::-1]) for w in windows)


def test_cifar10_constructing_reads_nothing(tmp_path: Path) -> None:
    dm = CIFAR10DataModule(tmp_path / "absent")
    assert (dm.num_classes, dm.input_shape) == (10, (3, 32, 32))
    assert dm.hparams.batch_size == 128 and dm.hparams.augment is True


def test_cifar10_missing_data_says_where_and_how_to_get_it(tmp_path: Path) -> None:
    root = tmp_path / "cifar"
    with pytest.raises(PlanningError) as info:
        CIFAR10DataModule(root).setup("fit")
    message = str(info.value)
    assert str(root) in message and "does not exist" in message
    assert "cifar-10-batches-py/data_batch_1..data_batch_5, test_batch" in message
    assert f"torchvision.datasets.CIFAR10('{root}', download=True)" in message
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in message
    assert "Dataset not found or corrupted" not in message
    write_cifar10(root)
    (root / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(PlanningError, match="lacks test_batch in cifar-10-batches-py/"):
        CIFAR10DataModule(root, verify_md5=False).setup("fit")
    with pytest.raises(PlanningError, match="pass its parent"):
        CIFAR10DataModule(root / "cifar-10-batches-py").setup("fit")


def test_cifar10_compares_the_official_checksums_by_default(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    with pytest.raises(PlanningError, match=r"md5 mismatch.*data_batch_1.*verify_md5=False"):
        CIFAR10DataModule(tmp_path).setup("fit")


# ---------------------------------------------------------------------------------------------- ImageNet


def write_image_folder(root: Path, classes: tuple[str, ...] = ("n01", "n02", "n03"), per_class: int = 2) -> None:
    """``root/train`` and ``root/val`` with ``per_class`` small random-colour JPEGs per class."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name in classes:
            (root / split / name).mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)  # 40 wide, 30 high
                Image.fromarray(pixels).save(root / split / name / f"{name}_{i}.JPEG", format="JPEG")


def test_imagenet_batches(tmp_path: Path) -> None:
    write_image_folder(tmp_path)
    dm = ImageNetDataModule(tmp_path, batch_size=4, num_workers=0, image_size=32, num_classes=3)
    assert (dm.num_classes, dm.input_shape) == (3, (3, 32, 32))
    dm.setup("fit")
    assert len(dm.train_dataset) == 6 and len(dm.val_dataset) == 6 and dm.test_dataset is dm.val_dataset
    for loader in (dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader(), dm.predict_dataloader()):
        x, y = next(iter(loader))
        assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
        assert set(y.tolist()) <= {0, 1, 2}
    assert torch.equal(dm.val_dataset[0][0], dm.val_dataset[0][0])  # evaluation is deterministic
    assert [dm.val_dataset[i][1] for i in range(6)] == [0, 0, 1, 1, 2, 2]


def test_imagenet_test_stage_reads_only_val(tmp_path: Path) -> None:
    write_image_folder(tmp_path)
    for path in sorted((tmp_path / "train").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    (tmp_path / "train").rmdir()
    dm = ImageNetDataModule(tmp_path, num_workers=0, image_size=32, num_classes=3)
    x, _ = next(iter(dm.test_dataloader()))
    assert x.shape == (6, 3, 32, 32)
    with pytest.raises(PlanningError, match="train folder not found"):
        dm.setup("fit")


def test_imagenet_class_count_mismatch(tmp_path: Path) -> None:
    write_image_folder(tmp_path)
    with pytest.raises(PlanningError, match="has 3 class folders but num_classes=1000; pass num_classes=3"):
        ImageNetDataModule(tmp_path).setup("fit")


def test_imagenet_missing_or_unsorted_folders(tmp_path: Path) -> None:
    with pytest.raises(PlanningError) as info:
        ImageNetDataModule(tmp_path / "absent", num_classes=3).setup("fit")
    message = str(info.value)
    assert str(tmp_path / "absent" / "train") in message and "is not a directory" in message
    assert "<root>/train/<class>/*.JPEG" in message and "<root>/val/<class>/*.JPEG" in message
    assert "valprep.sh" in message
    # validation images left flat, as ILSVRC-2012 ships them
    write_image_folder(tmp_path / "flat")
    for jpeg in (tmp_path / "flat" / "val").rglob("*.JPEG"):
        jpeg.rename(tmp_path / "flat" / "val" / jpeg.name)
    for folder in (tmp_path / "flat" / "val").iterdir():
        if folder.is_dir():
            folder.rmdir()
    with pytest.raises(PlanningError, match=r"val folder .* has 0 class folders but num_classes=3.*valprep\.sh"):
        ImageNetDataModule(tmp_path / "flat", num_classes=3).setup("fit")


def test_imagenet_train_and_val_classes_must_agree(tmp_path: Path) -> None:
    write_image_folder(tmp_path)
    (tmp_path / "val" / "n03").rename(tmp_path / "val" / "n04")
    with pytest.raises(PlanningError, match="different class folders \\(n03, n04 in only one of them\\)"):
        ImageNetDataModule(tmp_path, num_classes=3).setup("fit")


def test_imagenet_empty_class_folder(tmp_path: Path) -> None:
    write_image_folder(tmp_path)
    for jpeg in (tmp_path / "val" / "n02").iterdir():
        jpeg.unlink()
    with pytest.raises(PlanningError, match="Found no valid file for the classes n02"):
        ImageNetDataModule(tmp_path, num_classes=3).setup("validate")


# ---------------------------------------------------------------------------------------------- synthetic


def test_synthetic_is_deterministic_and_shaped() -> None:
    def data(seed: int) -> tuple[torch.Tensor, ...]:
        dm = SyntheticDataModule(input_shape=(2, 5, 7), num_classes=4, samples=33, batch_size=8, seed=seed)
        assert (dm.num_classes, dm.input_shape) == (4, (2, 5, 7))
        dm.setup()
        assert dm.train_dataset is dm.val_dataset is dm.test_dataset
        x, y = next(iter(dm.val_dataloader()))
        assert x.shape == (8, 2, 5, 7) and x.dtype == torch.float32 and y.dtype == torch.int64
        return dm.train_dataset.tensors

    (images, labels), (images_again, labels_again), (other, _) = data(1), data(1), data(2)
    assert images.shape == (33, 2, 5, 7) and labels.shape == (33,) and labels.min() >= 0 and labels.max() < 4
    assert torch.equal(images, images_again) and torch.equal(labels, labels_again)
    assert not torch.equal(images, other)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_shape": ()}, "input_shape must be a non-empty sequence"),
        ({"input_shape": (3, 0, 32)}, "every input_shape size must be a whole number >= 1; got 0"),
        ({"num_classes": 0}, "num_classes must be a whole number of classes >= 1"),
        ({"samples": 0}, "samples must be a whole number >= 1"),
    ],
)
def test_synthetic_refuses_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PlanningError, match=message):
        SyntheticDataModule(**kwargs)


# ---------------------------------------------------------------------------------------------- Lightning


def test_registry() -> None:
    registry = DATA_MODULES
    assert registry == {
        "digits": DigitsDataModule,
        "cifar10": CIFAR10DataModule,
        "imagenet": ImageNetDataModule,
        "synthetic": SyntheticDataModule,
    }


class _Linear(L.LightningModule):
    """A linear classifier built from a data module's ``input_shape`` and ``num_classes``."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), num_classes))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("name", ["digits", "cifar10", "imagenet", "synthetic"])
def test_each_data_module_feeds_a_lightning_fit(name: str, tmp_path: Path) -> None:
    if name == "digits":
        dm = DigitsDataModule(batch_size=16)
    elif name == "cifar10":
        write_cifar10(tmp_path)
        dm = CIFAR10DataModule(tmp_path, batch_size=4, num_workers=0, verify_md5=False)
    elif name == "imagenet":
        write_image_folder(tmp_path)
        dm = ImageNetDataModule(tmp_path, batch_size=2, num_workers=0, image_size=32, num_classes=3)
    else:
        dm = SyntheticDataModule(input_shape=(3, 8, 8), samples=32, batch_size=8)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(_Linear(dm.input_shape, dm.num_classes), datamodule=dm)
    assert trainer.state.finished and trainer.global_step == 2
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
