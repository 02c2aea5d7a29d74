"""A folder of one's own (``imagefolder``): one sub-folder of images per class, read where it lies
(``data.source_dir``). :func:`list_imagefolder` lists its images and counts what it leaves out; the fetch
stage checks the folder with it, the prepare stage lists it again and reads the images.
"""

from __future__ import annotations

import os
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddpipe.data.images import IMAGE_SUFFIXES, is_image_name
from ddpipe.data.verify import DataSourceError


@dataclass
class FileTable:
    """The images of a class-per-folder directory, in class then path order, without a Python object per
    file: relative paths packed into one byte array (``names`` split at ``offsets``), labels as int64. What
    the listing leaves out is counted: other files in the class folders (``not_images``), images at the root
    (``root_images``, the first few by name in ``root_examples``), and class folders without an image
    (``empty_folders``: each name with its count of other files)."""

    root: Path
    classes: list[str]
    names: np.ndarray
    offsets: np.ndarray
    labels: np.ndarray
    not_images: int
    root_images: int
    root_examples: list[str]
    empty_folders: list[tuple[str, int]]

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, i: int) -> str:
        rel = bytes(self.names[self.offsets[i]:self.offsets[i + 1]]).decode("utf-8", "surrogateescape")
        return str(self.root / self.classes[self.labels[i]] / rel)

    def left_out(self) -> list[str]:
        """A sentence for each kind of silent drop: images at the root, class folders without an image."""
        said = []
        if self.root_images:
            shown = ", ".join(self.root_examples) + (", ..." if self.root_images > len(self.root_examples) else "")
            said.append(f"{self.root_images} image file(s) at the root of {self.root}, not in a class folder, are left "
                        f"out ({shown}); each class is a sub-folder: move them into theirs")
        if self.empty_folders:
            shown = ", ".join(f"{name}/ ({other} other file(s))" if other else f"{name}/ (empty)"
                              for name, other in self.empty_folders)
            said.append(f"{len(self.empty_folders)} folder(s) of {self.root} hold no image and make no class: {shown}")
        return said


ROOT_EXAMPLES = 3  # root images named in the message


def list_imagefolder(root: Path, key: str = "data.source_dir") -> FileTable:
    """Every image under each class folder of ``root`` (sub-folders too, as torchvision's ImageFolder; any
    suffix case), sorted; other files, images at the root and folders without an image are counted and
    skipped (:meth:`FileTable.left_out`). DataSourceError unless there are at least two classes with images."""
    if not root.is_dir():
        raise DataSourceError(f"{key} = {str(root)!r}: not a directory")
    # array('q'): 8 bytes a file, where a list of ints would take 36
    blob, offsets, labels, classes, not_images = bytearray(), array("q", [0]), array("q"), [], 0
    empty: list[tuple[str, int]] = []
    for folder in sorted(d.name for d in os.scandir(root) if d.is_dir() and not d.name.startswith(".")):
        found, other = _images_under(root / folder)
        not_images += other
        if not found:
            empty.append((folder, other))
            continue
        for name in sorted(found):
            blob += name.encode("utf-8", "surrogateescape")
            offsets.append(len(blob))
        labels.extend([len(classes)] * len(found))
        classes.append(folder)
    at_root, examples = _root_images(root)
    if len(classes) < 2:
        loose = f"; {at_root} image(s) lie at its root, outside any class folder" if at_root else ""
        raise DataSourceError(
            f"{key} = {str(root)!r}: expected one sub-folder of images per class "
            f"(at least 2 classes; image suffixes {sorted(IMAGE_SUFFIXES)}, any case), found {classes}{loose}"
        )
    return FileTable(root, classes, np.frombuffer(bytes(blob), dtype=np.uint8), np.asarray(offsets, dtype=np.int64),
                     np.asarray(labels, dtype=np.int64), not_images, at_root, examples, empty)


def _root_images(root: Path) -> tuple[int, list[str]]:
    """How many image files lie at ``root`` itself (not hidden), and the first ``ROOT_EXAMPLES`` of them by name."""
    count, examples = 0, []
    for entry in os.scandir(root):
        if entry.is_file() and is_image_name(entry.name) and not entry.name.startswith("."):
            count += 1
            examples = sorted([*examples, entry.name])[:ROOT_EXAMPLES]
    return count, examples


def _images_under(folder: Path) -> tuple[list[str], int]:
    """The image files under ``folder`` (paths relative to it; hidden files and folders skipped), and the number
    of its other files."""
    found, other = [], 0
    for parent, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel = os.path.relpath(parent, folder)
        for name in files:
            if is_image_name(name) and not name.startswith("."):
                found.append(name if rel == "." else os.path.join(rel, name))
            else:
                other += 1
    return found, other
