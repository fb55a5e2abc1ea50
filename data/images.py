"""Images for the task encoders: how many tokens an image becomes, and the two image modes that turn a decoded image
into the vision encoder's input (see task_encoder.py for how a sample's placeholders follow from them).

* `FixedTiles`: the image is resized to `image_size` x `image_size` and normalized; one tile gives
  `tile_num_tokens(image_size, patch_size, pixel_shuffle_factor)` tokens. The encoder input is
  `{"x": FloatTensor[N_images, 3, H, W]}`.
* `DynamicResolution`: the image keeps its aspect ratio and is resized so that its patch grid `(h_patches,
  w_patches)` has between `min_patches` and `max_patches` patches (each side a multiple of the patch size; the grid
  by `grid_rule`: the closest fit, `fit_patch_grid`, or the Nemotron omni processor's scaled grid,
  `scaled_grid.scaled_patch_grid`), then cut
  into `[num_patches, C*P*P]` patch rows (patch-row-major, each row `(c, y, x)` flattened, as megatron-core's RADIO
  patchifies). The encoder input is one packed buffer: `{"x": [1, total_patches, C*P*P], "imgs_sizes":
  LongTensor[N, 2], "packed_seq_params": PackedSeqParams(thd, cumulative patch counts)}`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal, Sequence

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from .scaled_grid import scaled_patch_grid

__all__ = [
    "DynamicResolution", "FixedTiles", "ImageMode", "ProcessedImage", "dynamic_num_tokens", "fit_patch_grid",
    "patchify", "tile_num_tokens", "to_float_image",
]

SIGLIP_MEAN = (0.5, 0.5, 0.5)
SIGLIP_STD = (0.5, 0.5, 0.5)


# ---------------------------------------------------------------------------------------------------------------
# Token counts and image geometry


def _shuffle_side(pixel_shuffle_factor: int) -> int:
    side = math.isqrt(pixel_shuffle_factor)
    if pixel_shuffle_factor < 1 or side * side != pixel_shuffle_factor:
        raise ValueError(f"pixel_shuffle_factor must be a perfect square >= 1 (1, 4, 9, ...), "
                         f"got {pixel_shuffle_factor}")
    return side


def tile_num_tokens(image_size: int, patch_size: int, pixel_shuffle_factor: int = 1) -> int:
    """Tokens one `image_size` x `image_size` tile gives: `(image_size / patch_size)^2 / pixel_shuffle_factor`."""
    if image_size <= 0 or patch_size <= 0 or image_size % patch_size:
        raise ValueError(f"image_size {image_size} must be a positive multiple of patch_size {patch_size}")
    grid = image_size // patch_size
    side = _shuffle_side(pixel_shuffle_factor)
    if grid % side:
        raise ValueError(f"a {grid}x{grid} patch grid cannot be pixel-shuffled by {pixel_shuffle_factor}")
    return grid * grid // pixel_shuffle_factor


def dynamic_num_tokens(h_patches: int, w_patches: int, pixel_shuffle_factor: int = 1) -> int:
    """Tokens an image with an `h_patches` x `w_patches` patch grid gives."""
    side = _shuffle_side(pixel_shuffle_factor)
    if h_patches <= 0 or w_patches <= 0 or h_patches % side or w_patches % side:
        raise ValueError(f"patch grid {h_patches}x{w_patches} is not a positive multiple of {side} per side")
    return h_patches * w_patches // pixel_shuffle_factor


@lru_cache(maxsize=4096)
def fit_patch_grid(height: int, width: int, patch_size: int, min_patches: int, max_patches: int,
                   step: int = 1) -> tuple[int, int]:
    """The patch grid `(h_patches, w_patches)` for an image of `height` x `width` pixels.

    Both sides are multiples of `step` (in patches) and `min_patches <= h * w <= max_patches`. Among those grids it
    picks the one closest to the image's aspect ratio and to its native patch count (clamped into the range), both
    measured in log space; an image whose native grid already fits is only rounded to whole patches.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if not 1 <= min_patches <= max_patches:
        raise ValueError(f"need 1 <= min_patches <= max_patches, got {min_patches}, {max_patches}")
    aspect = width / height
    target = min(max((height / patch_size) * (width / patch_size), min_patches), max_patches)
    log_aspect, log_target = math.log(aspect), math.log(target)
    # The error of a grid, |log(w/h) - log_aspect| + |log(h*w) - log_target|, is at least |2 log h - centre| (the
    # triangle inequality), so only heights near exp(centre / 2) can win: scan outwards from there until that bound
    # passes the best error found, then pick among the heights inside the bound in increasing order (the order,
    # and so the tie-breaking, of a scan over every height).
    centre = log_target - log_aspect
    heights = range(step, max_patches // step * step + 1, step)

    def bound(i: int) -> float:  # the least error a height can reach; none past either end
        return abs(2 * math.log(heights[i]) - centre) if 0 <= i < len(heights) else math.inf

    below = min(max(math.ceil(math.exp(centre / 2) / step) - 1, 0), len(heights) - 1)  # nearest the ideal
    above, best_err, scanned = below + 1, math.inf, {}
    while (nearest := min(bound(below), bound(above))) < math.inf and nearest <= best_err + 1e-9:
        if bound(below) <= bound(above):
            i, below = below, below - 1
        else:
            i, above = above, above + 1
        grids = scanned[heights[i]] = list(_grids_of_height(heights[i], step, min_patches, max_patches, target,
                                                            aspect, log_aspect, log_target))
        best_err = min([best_err] + [err for _, err in grids])
    if best_err == math.inf:
        raise ValueError(f"no patch grid with sides that are multiples of {step} has between {min_patches} and "
                         f"{max_patches} patches")
    best, best_so_far = None, math.inf
    for hp in sorted(scanned):
        for grid, err in scanned[hp]:
            if err < best_so_far - 1e-12:
                best, best_so_far = grid, err
    return best


def _grids_of_height(hp, step, min_patches, max_patches, target, aspect, log_aspect, log_target):
    """The candidate grids `((hp, wp), error)` of height `hp`: the widths keeping the area and the aspect ratio,
    each rounded down and up to a multiple of `step` and clamped into the patch range."""
    lo = -(-max(min_patches, 1) // hp)  # ceil
    lo = max(-(-lo // step) * step, step)
    hi = max_patches // hp // step * step
    if lo > hi:
        return
    for w_float in (target / hp, hp * aspect):
        for wp in {int(math.floor(w_float / step)) * step, int(math.ceil(w_float / step)) * step}:
            wp = min(max(wp, lo), hi)
            yield (hp, wp), abs(math.log(wp / hp) - log_aspect) + abs(math.log(hp * wp) - log_target)


def patchify(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """`[C, H, W]` -> `[(H/P) * (W/P), C*P*P]`: patches in row-major order, each flattened as (c, y, x)."""
    c, h, w = image.shape
    if h % patch_size or w % patch_size:
        raise ValueError(f"image {h}x{w} is not a multiple of patch size {patch_size}")
    hp, wp = h // patch_size, w // patch_size
    x = image.reshape(c, hp, patch_size, wp, patch_size)
    return x.permute(1, 3, 0, 2, 4).reshape(hp * wp, c * patch_size * patch_size)


def to_float_image(image: Any) -> torch.Tensor:
    """An image as `float32 [3, H, W]` in [0, 1]: from energon's decoded tensor (float or uint8), a PIL image or a
    `[H, W, C]` numpy array. Grey images are repeated to RGB; an alpha channel is dropped."""
    if not isinstance(image, torch.Tensor):
        try:
            from PIL import Image
        except ImportError:  # pragma: no cover - PIL ships with energon's image decoding
            Image = None
        if Image is not None and isinstance(image, Image.Image):
            import numpy as np

            image = torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)
        else:
            image = torch.as_tensor(image)
            if image.ndim == 3 and image.shape[-1] in (1, 3, 4) and image.shape[0] not in (1, 3, 4):
                image = image.permute(2, 0, 1)
    if image.ndim == 2:
        image = image[None]
    if image.ndim != 3:
        raise ValueError(f"expected an image [C, H, W], got shape {tuple(image.shape)}")
    if image.dtype == torch.uint8:
        image = image.float() / 255.0
    else:
        image = image.float()
    if image.shape[0] == 1:
        image = image.expand(3, -1, -1)
    elif image.shape[0] == 4:
        image = image[:3]
    elif image.shape[0] != 3:
        raise ValueError(f"expected 1, 3 or 4 channels, got {image.shape[0]}")
    return image


def _resize(image: torch.Tensor, height: int, width: int, mode: str = "bilinear") -> torch.Tensor:
    if tuple(image.shape[-2:]) == (height, width):
        return image
    return F.interpolate(image[None], size=(height, width), mode=mode, align_corners=False, antialias=True)[0]


def _normalize(image: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    m = torch.tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    s = torch.tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return (image - m) / s


# ---------------------------------------------------------------------------------------------------------------
# Image modes


@dataclass
class ProcessedImage:
    pixels: torch.Tensor  # fixed tiles: [tiles, 3, S, S]; dynamic resolution: [num_patches, C*P*P]
    grid: tuple[int, int]  # patch grid (h_patches, w_patches) of one tile / of the image
    num_tokens: int  # placeholders this image takes in the token sequence
    size: tuple[int, int]  # (height, width) in pixels after resizing

    @property
    def encoder_patches(self) -> list[int]:
        """The patches of each sequence the encoder makes of this image: one per tile (fixed tiles), else the
        image's own grid; what its FLOPs follow (`sample_flops`)."""
        tiles = self.pixels.shape[0] if self.pixels.ndim == 4 else 1
        return [self.grid[0] * self.grid[1]] * tiles


@dataclass(frozen=True)
class FixedTiles:
    """Every image becomes one `image_size` x `image_size` tile."""

    image_size: int = 32
    patch_size: int = 8
    pixel_shuffle_factor: int = 1
    mean: tuple[float, ...] = SIGLIP_MEAN
    std: tuple[float, ...] = SIGLIP_STD
    kind: Literal["fixed"] = field(default="fixed", init=False)

    def __post_init__(self):
        tile_num_tokens(self.image_size, self.patch_size, self.pixel_shuffle_factor)  # validates

    @property
    def tokens_per_tile(self) -> int:
        return tile_num_tokens(self.image_size, self.patch_size, self.pixel_shuffle_factor)

    def num_tokens(self, height: int, width: int) -> int:
        return self.tokens_per_tile

    def num_patches(self, height: int, width: int) -> int:
        """Patches the encoder reads for an image (before pixel shuffle): one tile's."""
        return (self.image_size // self.patch_size) ** 2

    def process(self, image: torch.Tensor) -> ProcessedImage:
        tile = _normalize(_resize(image, self.image_size, self.image_size), self.mean, self.std)
        g = self.image_size // self.patch_size
        return ProcessedImage(pixels=tile[None], grid=(g, g), num_tokens=self.tokens_per_tile,
                              size=(self.image_size, self.image_size))

    def collate(self, images: list[ProcessedImage]) -> dict:
        return {"x": torch.cat([p.pixels for p in images], dim=0)}

    @staticmethod
    def concat(inputs: list[dict]) -> dict:
        """Several collated encoder inputs as one: the tiles one after another."""
        return {"x": torch.cat([i["x"] for i in inputs], dim=0)}


@dataclass(frozen=True)
class DynamicResolution:
    """Every image keeps its aspect ratio; its patch count lies in `[min_patches, max_patches]`.

    `imgs_sizes` in the encoder input is per image `(height, width)` in pixels (megatron-core's RADIO convention:
    it derives the patch counts as `imgs_sizes // patch_size`), or `(h_patches, w_patches)` with
    `imgs_sizes_unit="patches"`.

    `grid_rule` "closest" picks the grid closest to the image's aspect ratio and patch count (`fit_patch_grid`);
    "scaled" scales the image's own grid into the range as the Nemotron omni processor does
    (`scaled_patch_grid`). `resample` is the resize's interpolation (antialiased; the omni processor's is bicubic).
    """

    patch_size: int = 8
    min_patches: int = 4
    max_patches: int = 64
    pixel_shuffle_factor: int = 1
    mean: tuple[float, ...] = SIGLIP_MEAN
    std: tuple[float, ...] = SIGLIP_STD
    imgs_sizes_unit: Literal["pixels", "patches"] = "pixels"
    grid_rule: Literal["closest", "scaled"] = "closest"
    resample: Literal["bilinear", "bicubic"] = "bilinear"
    kind: Literal["dynamic"] = field(default="dynamic", init=False)

    def __post_init__(self):
        if self.patch_size <= 0:
            raise ValueError(f"patch_size must be positive, got {self.patch_size}")
        if self.imgs_sizes_unit not in ("pixels", "patches"):
            raise ValueError(f"imgs_sizes_unit must be 'pixels' or 'patches', got {self.imgs_sizes_unit!r}")
        if self.grid_rule not in ("closest", "scaled") or self.resample not in ("bilinear", "bicubic"):
            raise ValueError(f"grid_rule must be 'closest' or 'scaled' and resample 'bilinear' or 'bicubic', got "
                             f"{self.grid_rule!r}, {self.resample!r}")
        fit_patch_grid(1, 1, self.patch_size, self.min_patches, self.max_patches, self.step)  # validates

    @property
    def step(self) -> int:
        return _shuffle_side(self.pixel_shuffle_factor)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        if self.grid_rule == "scaled":
            return scaled_patch_grid(int(height), int(width), self.patch_size, self.min_patches, self.max_patches,
                                     self.step)
        return fit_patch_grid(int(height), int(width), self.patch_size, self.min_patches, self.max_patches,
                              self.step)

    def num_tokens(self, height: int, width: int) -> int:
        return dynamic_num_tokens(*self.grid(height, width), self.pixel_shuffle_factor)

    def num_patches(self, height: int, width: int) -> int:
        """Patches the encoder reads for an image (before pixel shuffle): its grid's."""
        rows, cols = self.grid(height, width)
        return rows * cols

    def process(self, image: torch.Tensor) -> ProcessedImage:
        hp, wp = self.grid(image.shape[-2], image.shape[-1])
        h, w = hp * self.patch_size, wp * self.patch_size
        pixels = _normalize(_resize(image, h, w, self.resample), self.mean, self.std)
        return ProcessedImage(pixels=patchify(pixels, self.patch_size), grid=(hp, wp),
                              num_tokens=dynamic_num_tokens(hp, wp, self.pixel_shuffle_factor), size=(h, w))

    def collate(self, images: list[ProcessedImage]) -> dict:
        counts = [p.pixels.shape[0] for p in images]
        sizes = [p.size if self.imgs_sizes_unit == "pixels" else p.grid for p in images]
        return {
            "x": torch.cat([p.pixels for p in images], dim=0)[None],
            "imgs_sizes": torch.tensor(sizes, dtype=torch.long).reshape(len(images), 2),
            "packed_seq_params": _packed(counts),
        }

    @staticmethod
    def concat(inputs: list[dict]) -> dict:
        """Several collated encoder inputs (on the host) as one packed buffer: the images one after another, their
        THD boundaries rebuilt. An encoder's output for it is the outputs for `inputs` concatenated."""
        counts = [int(n) for i in inputs for n in i["packed_seq_params"].cu_seqlens_q.diff().tolist()]
        return {
            "x": torch.cat([i["x"] for i in inputs], dim=1),
            "imgs_sizes": torch.cat([i["imgs_sizes"] for i in inputs], dim=0),
            "packed_seq_params": _packed(counts),
        }


def _packed(counts: list[int]) -> PackedSeqParams:
    """THD boundaries (on the host) of images of `counts` patches packed one after another."""
    cu = torch.zeros(len(counts) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0).to(torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(),
                           max_seqlen_q=max(counts), max_seqlen_kv=max(counts))


ImageMode = FixedTiles | DynamicResolution
