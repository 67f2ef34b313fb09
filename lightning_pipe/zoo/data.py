"""Lightning data modules for the image classification jobs.

Every module knows ``num_classes`` and ``input_shape`` (C, H, W) as soon as it is constructed, without
touching the disk, because the model is built from them; the data is read in ``setup()``. Training
loaders shuffle; where the module has a ``seed`` the shuffling draws from a ``torch.Generator`` seeded
with it, so every process of a pipeline reads the batches in the same order (without one, the
pipeline strategy gives the sampler a generator seeded alike on every rank). ``predict_dataloader``
serves the test data.

* :class:`DigitsDataModule` reads scikit-learn's handwritten digits (``load_digits()``: 1797 8x8
  grey images with values 0..16, shipped inside scikit-learn, nothing is downloaded). The images are
  divided by 16, then normalised with the mean and standard deviation of the training split's pixels.
  A permutation drawn from ``torch.Generator().manual_seed(seed)`` splits them into train, validation
  and test sets (:func:`split_indices`). ``channels=3`` repeats the grey channel into an RGB image, the
  input the torchvision models take (their CIFAR variants run on 8x8 images).
* :class:`CIFAR10DataModule` reads the python version of CIFAR-10 with torchvision's
  ``datasets.CIFAR10`` (``download=False``). Training images are augmented as in He et al., "Deep
  Residual Learning for Image Recognition" (CVPR 2016), section 4.2: a random 32x32 crop of the image
  padded by 4 pixels on each side and a random horizontal flip; then every image is turned into a
  tensor and normalised with the usual per-channel CIFAR-10 mean and standard deviation. Validation
  uses the test split, or the last ``val_size`` training images (never augmented).
* :class:`ImageNetDataModule` reads ILSVRC-2012 arranged for ``datasets.ImageFolder``
  (``<root>/train/<class>/*.JPEG`` and ``<root>/val/<class>/*.JPEG``) with the transforms of
  torchvision's reference classification training scripts (``references/classification/presets.py``):
  training ``RandomResizedCrop(image_size)`` and a random horizontal flip, evaluation
  ``Resize(image_size * 256 / 224)`` and ``CenterCrop(image_size)``, then the ImageNet mean and
  standard deviation. The validation images also serve as the test set (ImageNet's test labels are
  not public).
* :class:`SyntheticDataModule` draws standard normal images and uniform labels once from a seeded
  generator, for throughput runs; the same samples serve training, validation and testing.

Missing data is reported before torchvision gets to it (its own message is "Dataset not found or
corrupted"): ``setup()`` raises :class:`~lightning_pipe.errors.PlanningError` naming the directory
searched, the layout expected and how to obtain the data.

torchvision's ``CIFAR10`` compares the md5 sum of every file with those of the official archive, so
it can only read the official files. :class:`CIFAR10DataModule` compares the same checksums itself
(``verify_md5=True``, the default, with a message naming the files that differ) and then reads the
files with a subclass of ``datasets.CIFAR10`` whose checksums are ``None``, which torchvision treats
as "the file exists"; its reading code is used unchanged. ``verify_md5=False`` reads files of the same
format that are not the official ones (a subset, or small test files).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning import LightningDataModule
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchvision import datasets
from torchvision import transforms as T
from torchvision.datasets.utils import check_integrity

from lightning_pipe.errors import PlanningError, check_whole

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "DATA_MODULES",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "CIFAR10DataModule",
    "DigitsDataModule",
    "ImageNetDataModule",
    "SyntheticDataModule",
    "split_indices",
]

CIFAR10_MEAN: tuple[float, float, float] = (0.4914, 0.4822, 0.4465)
CIFAR10_STD: tuple[float, float, float] = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

DIGITS_COUNT = 1797
CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"


def _check_seed(seed: object) -> None:
    check_whole("seed", seed, 0)


def _check_fraction(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise PlanningError(f"{name} must be a fraction strictly between 0 and 1 (e.g. 0.15); got {value!r}")


def _where(path: Path) -> str:
    """``path``, followed by its absolute form when it is relative."""
    return str(path) if path.is_absolute() else f"{path} ({path.resolve()})"


def split_indices(
    n: int, val_fraction: float, test_fraction: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split ``range(n)`` into sorted train, validation and test indices.

    The validation and test sets hold ``round(fraction * n)`` items each, the training set the rest;
    which items is decided by ``torch.randperm(n)`` drawn from a generator seeded with ``seed``, so the
    same arguments give the same split on every process and every run.
    """
    check_whole("n", n, 3, "items")
    _check_fraction("val_fraction", val_fraction)
    _check_fraction("test_fraction", test_fraction)
    _check_seed(seed)
    if val_fraction + test_fraction >= 1:
        raise PlanningError(
            f"val_fraction + test_fraction must be < 1 to leave images for training; got "
            f"{val_fraction} + {test_fraction} = {val_fraction + test_fraction}"
        )
    sizes = {"validation": round(val_fraction * n), "test": round(test_fraction * n)}
    sizes["training"] = n - sizes["validation"] - sizes["test"]
    for split, size in sizes.items():
        if size < 1:
            raise PlanningError(
                f"val_fraction={val_fraction}, test_fraction={test_fraction} leave no {split} item out of {n}; "
                f"every fraction must cover at least one item (>= {1 / n:.2g}) and their sum must leave one"
            )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    test, val, train = torch.split(order, [sizes["test"], sizes["validation"], sizes["training"]])
    return train.sort().values, val.sort().values, test.sort().values


class _Transformed(Dataset):
    """Items ``indices`` of ``dataset`` (image, label) with ``transform`` applied to the image."""

    def __init__(self, dataset: Dataset, indices: Sequence[int], transform: Callable[[Any], Any]) -> None:
        self.dataset = dataset
        self.indices = indices
        self.transform = transform

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image, label = self.dataset[self.indices[index]]
        return self.transform(image), label


class _SplitDataModule(LightningDataModule):
    """Loaders over ``train_dataset``, ``val_dataset`` and ``test_dataset``, which ``setup`` fills."""

    num_classes: int
    input_shape: tuple[int, ...]

    def __init__(self, batch_size: int, num_workers: int, seed: int | None) -> None:
        super().__init__()
        check_whole("batch_size", batch_size, 1, "images")
        check_whole("num_workers", num_workers, 0, "worker processes")
        if seed is not None:
            _check_seed(seed)
        self._batch_size = batch_size
        self._num_workers = num_workers
        self._seed = seed
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None

    def _dataset(self, split: str, stage: str) -> Dataset:
        """The split's dataset, running ``setup(stage)`` first when it has not been made yet."""
        if getattr(self, f"{split}_dataset") is None:
            self.setup(stage)
        return getattr(self, f"{split}_dataset")

    def _loader(self, dataset: Dataset, *, shuffle: bool) -> DataLoader:
        generator = torch.Generator().manual_seed(self._seed) if shuffle and self._seed is not None else None
        return DataLoader(
            dataset,
            batch_size=self._batch_size,
            shuffle=shuffle,
            generator=generator,
            num_workers=self._num_workers,
            persistent_workers=self._num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches (a new loader starts the seeded order afresh)."""
        return self._loader(self._dataset("train", "fit"), shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._dataset("val", "validate"), shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self._dataset("test", "test"), shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        """The test data, in order."""
        return self._loader(self._dataset("test", "predict"), shuffle=False)


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as (1797, 1, 8, 8) float32 in [0, 1] and int64 labels (do not modify)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16
    return images, torch.as_tensor(digits.target, dtype=torch.int64)


class DigitsDataModule(_SplitDataModule):
    """scikit-learn's 8x8 handwritten digits, split by a seeded permutation (see the module docstring).

    After ``setup()``: ``indices`` maps ``"train"``, ``"val"``, ``"test"`` to the images' positions in
    ``load_digits()``; ``mean`` and ``std`` are the training statistics used to normalise every split.
    """

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        seed: int = 0,
        num_workers: int = 0,
        channels: int = 1,
    ) -> None:
        super().__init__(batch_size, num_workers, seed)
        split_indices(DIGITS_COUNT, val_fraction, test_fraction, seed)  # validates without reading data
        if channels not in (1, 3):
            raise PlanningError(f"channels must be 1 (grey) or 3 (grey repeated as RGB); got {channels!r}")
        self.save_hyperparameters()
        self.num_classes = 10
        self.input_shape = (channels, 8, 8)
        self.indices: dict[str, torch.Tensor] = {}
        self.mean: float | None = None
        self.std: float | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        images, labels = _digits()
        train, val, test = split_indices(len(images), self.hparams.val_fraction, self.hparams.test_fraction, self._seed)
        self.indices = {"train": train, "val": val, "test": test}
        self.mean = images[train].mean().item()
        self.std = images[train].std().item()
        normalised = ((images - self.mean) / self.std).repeat(1, self.hparams.channels, 1, 1)
        self.train_dataset = TensorDataset(normalised[train], labels[train])
        self.val_dataset = TensorDataset(normalised[val], labels[val])
        self.test_dataset = TensorDataset(normalised[test], labels[test])


class _CIFAR10Files(datasets.CIFAR10):
    """torchvision's CIFAR-10 reader with the md5 sums set to ``None``: its integrity check then only
    asks that each file exists (:class:`CIFAR10DataModule` compares the checksums itself)."""

    train_list = [[name, None] for name, _ in datasets.CIFAR10.train_list]  # noqa: RUF012
    test_list = [[name, None] for name, _ in datasets.CIFAR10.test_list]  # noqa: RUF012
    meta = {**datasets.CIFAR10.meta, "md5": None}  # noqa: RUF012


def _cifar10_files() -> list[tuple[str, str]]:
    """(file name, official md5) of every file torchvision's CIFAR10 reads."""
    listed = datasets.CIFAR10.train_list + datasets.CIFAR10.test_list
    meta = datasets.CIFAR10.meta
    return [(name, md5) for name, md5 in listed] + [(meta["filename"], meta["md5"])]


class CIFAR10DataModule(_SplitDataModule):
    """CIFAR-10 (python version) from ``root``, never downloaded (see the module docstring).

    Args:
        root: the directory holding ``cifar-10-batches-py/``.
        batch_size: images per batch.
        num_workers: loader worker processes.
        augment: random crop with 4-pixel padding and horizontal flip for training images.
        val_size: 0 validates on the test split; otherwise the last ``val_size`` training images are
            held out for validation (without augmentation).
        seed: seed of the training order.
        verify_md5: compare the files' md5 sums with the official archive's (``False`` reads other
            files of the same format).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] = "data/cifar10",
        batch_size: int = 128,
        num_workers: int = 2,
        augment: bool = True,
        val_size: int = 0,
        seed: int = 0,
        *,
        verify_md5: bool = True,
    ) -> None:
        super().__init__(batch_size, num_workers, seed)
        if not isinstance(augment, bool):
            raise PlanningError(f"augment must be True or False; got {augment!r}")
        if not isinstance(verify_md5, bool):
            raise PlanningError(f"verify_md5 must be True or False; got {verify_md5!r}")
        check_whole("val_size", val_size, 0, "images")
        self.save_hyperparameters()
        self.root = Path(root)
        self.num_classes = 10
        self.input_shape = (3, 32, 32)
        normalise = [T.ToTensor(), T.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
        crop_flip = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()] if augment else []
        self.train_transform = T.Compose(crop_flip + normalise)
        self.eval_transform = T.Compose(normalise)

    def _check_files(self) -> None:
        """Refuse a root without the dataset's files (or, with ``verify_md5``, with other files)."""
        folder = self.root / CIFAR10_FOLDER
        missing = [name for name, _ in _cifar10_files() if not (folder / name).is_file()]
        if missing:
            found = "does not exist" if not self.root.is_dir() else f"lacks {', '.join(missing)} in {CIFAR10_FOLDER}/"
            hint = ""
            if (self.root / "data_batch_1").is_file():
                hint = f" (root holds the batches themselves: pass its parent, {self.root.parent})"
            elif (self.root / Path(CIFAR10_URL).name).is_file():
                hint = f" ({Path(CIFAR10_URL).name} is there but not extracted)"
            raise PlanningError(
                f"CIFAR-10 not found: root {_where(self.root)} {found}{hint}. Expected the python "
                f"version: <root>/{CIFAR10_FOLDER}/data_batch_1..data_batch_5, test_batch, batches.meta. "
                f"Get it with: python -c \"import torchvision; torchvision.datasets.CIFAR10('{self.root}', "
                f'download=True)", or download {CIFAR10_URL} and extract it into {self.root}'
            )
        if self.hparams.verify_md5:
            differ = [name for name, md5 in _cifar10_files() if not check_integrity(str(folder / name), md5)]
            if differ:
                raise PlanningError(
                    f"CIFAR-10 files in {folder} differ from the official archive (md5 mismatch): "
                    f"{', '.join(differ)}; they are corrupted or not the official files. Download "
                    f"{CIFAR10_URL} again and extract it into {self.root}, or pass verify_md5=False to read "
                    "your own files of the same format"
                )

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        self._check_files()
        train = _CIFAR10Files(str(self.root), train=True, download=False)
        test = _CIFAR10Files(str(self.root), train=False, download=False)
        val_size = self.hparams.val_size
        if val_size >= len(train):
            raise PlanningError(
                f"val_size={val_size} holds out every training image ({len(train)} in {self.root}); "
                f"use 0 (validate on the test split) or a number below {len(train)}"
            )
        kept = len(train) - val_size
        self.train_dataset = _Transformed(train, range(kept), self.train_transform)
        self.test_dataset = _Transformed(test, range(len(test)), self.eval_transform)
        if val_size:
            self.val_dataset = _Transformed(train, range(kept, len(train)), self.eval_transform)
        else:
            self.val_dataset = self.test_dataset


def _class_folders(folder: Path) -> list[str]:
    """Sub-folder names as ``ImageFolder`` finds its classes (every directory entry, sorted)."""
    return sorted(entry.name for entry in os.scandir(folder) if entry.is_dir())


class ImageNetDataModule(_SplitDataModule):
    """ILSVRC-2012 in ``ImageFolder`` layout under ``root`` (see the module docstring).

    The training loader has no generator of its own; the pipeline strategy seeds its sampler alike on
    every rank. ``setup("fit")`` (or ``setup()``) reads ``train/`` and ``val/``, the other stages only
    ``val/``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] = "data/imagenet",
        batch_size: int = 256,
        num_workers: int = 8,
        image_size: int = 224,
        num_classes: int = 1000,
    ) -> None:
        super().__init__(batch_size, num_workers, None)
        check_whole("image_size", image_size, 1, "pixels")
        check_whole("num_classes", num_classes, 1, "classes")
        self.save_hyperparameters()
        self.root = Path(root)
        self.num_classes = num_classes
        self.input_shape = (3, image_size, image_size)
        normalise = [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
        self.train_transform = T.Compose([T.RandomResizedCrop(image_size), T.RandomHorizontalFlip(), *normalise])
        self.eval_transform = T.Compose([T.Resize(int(image_size * 256 / 224)), T.CenterCrop(image_size), *normalise])

    def _layout(self) -> str:
        return (
            "Expected the ImageFolder layout: <root>/train/<class>/*.JPEG and <root>/val/<class>/*.JPEG, one "
            "folder per class (e.g. n01440764), the same class folders in train/ and val/. The ILSVRC-2012 "
            "validation images come in one flat folder: sort them into class folders first, e.g. with the "
            "widely used valprep.sh"
        )

    def _folder(self, split: str) -> datasets.ImageFolder:
        """``ImageFolder(root/split)`` after checking the folder and its number of classes."""
        folder = self.root / split
        if not folder.is_dir():
            raise PlanningError(
                f"ImageNet {split} folder not found: {_where(folder)} is not a directory "
                f"(root {str(self.root)!r}). {self._layout()}"
            )
        classes = _class_folders(folder)
        if len(classes) != self.num_classes:
            raise PlanningError(
                f"ImageNet {split} folder {folder} has {len(classes)} class folders but num_classes="
                f"{self.num_classes}; pass num_classes={len(classes)} or fix the folder. {self._layout()}"
            )
        try:
            return datasets.ImageFolder(str(folder))
        except FileNotFoundError as error:
            raise PlanningError(f"ImageNet {split} folder {folder}: {error}. {self._layout()}") from None

    def setup(self, stage: str | None = None) -> None:
        train = self._folder("train") if stage in (None, "fit") and self.train_dataset is None else None
        if self.val_dataset is None:
            val = self._folder("val")
            self.val_dataset = self.test_dataset = _Transformed(val, range(len(val)), self.eval_transform)
        if train is not None:
            val_classes = self.val_dataset.dataset.classes
            if train.classes != val_classes:
                only = sorted(set(train.classes) ^ set(val_classes))
                raise PlanningError(
                    f"ImageNet train/ and val/ under {self.root} have different class folders ({', '.join(only[:5])}"
                    f"{', ...' if len(only) > 5 else ''} in only one of them), so their labels would not match. "
                    f"{self._layout()}"
                )
            self.train_dataset = _Transformed(train, range(len(train)), self.train_transform)


class SyntheticDataModule(_SplitDataModule):
    """Random images and labels for throughput runs: ``samples`` standard normal images of
    ``input_shape`` and uniform labels below ``num_classes``, drawn once from a generator seeded with
    ``seed``; training, validation and testing all use them."""

    def __init__(
        self,
        input_shape: tuple[int, ...] = (3, 32, 32),
        num_classes: int = 10,
        samples: int = 1024,
        batch_size: int = 128,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, 0, seed)
        if isinstance(input_shape, (str, bytes)) or not isinstance(input_shape, Sequence) or not input_shape:
            raise PlanningError(
                f"input_shape must be a non-empty sequence of sizes, e.g. (3, 32, 32); got {input_shape!r}"
            )
        for size in input_shape:
            check_whole("every input_shape size", size, 1)
        check_whole("num_classes", num_classes, 1, "classes")
        check_whole("samples", samples, 1)
        input_shape = tuple(input_shape)  # saved as the model saves it: Lightning refuses a list beside a tuple
        self.save_hyperparameters()
        self.num_classes = num_classes
        self.input_shape = input_shape

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        generator = torch.Generator().manual_seed(self._seed)
        images = torch.randn((self.hparams.samples, *self.input_shape), generator=generator)
        labels = torch.randint(self.num_classes, (self.hparams.samples,), generator=generator)
        self.train_dataset = self.val_dataset = self.test_dataset = TensorDataset(images, labels)


DATA_MODULES: dict[str, type[LightningDataModule]] = {
    "digits": DigitsDataModule,
    "cifar10": CIFAR10DataModule,
    "imagenet": ImageNetDataModule,
    "synthetic": SyntheticDataModule,
}
