"""Images for the Qwen3.5-VL vision tower: the processor's resize rule, the patch layout the tower reads, and an image
mode for the task encoders (`GridImages`: `num_tokens` / `process` / `collate` / `concat`, like mimo's
`DynamicResolution`).

The reference is transformers' `Qwen2VLImageProcessor` (the processor of `qwen3_5` and `qwen3_5_moe`):

* grid: `smart_resize` keeps the aspect ratio, rounds each side to a multiple of `factor = patch_size * merge_size`
  and scales the image into `[min_pixels, max_pixels]` (aspect ratios over 200 are refused);
* pixels: the image resized to that size (bicubic, antialiased, rounded to 8 bits as the processor's uint8 path
  does), rescaled to [0, 1] and normalized with `image_mean` / `image_std`;
* layout: `[grid_h * grid_w, C * T * P * P]` rows in merge-block order (block row, block column, row in block,
  column in block), each row `(c, t, y, x)` with the image repeated over the `T` frames of a temporal patch; the
  `grid_thw` of an image is `(1, grid_h, grid_w)` in patches. Each `merge_size` x `merge_size` block of rows becomes
  one LLM token in the patch merger, so an image takes `grid_h * grid_w / merge_size**2` placeholders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal, Sequence

import torch
import torch.nn.functional as F

MAX_ASPECT_RATIO = 200  # the processor refuses longer or flatter images

# Qwen3-VL / Qwen3.5's preprocessor_config.json: 16-pixel patches merged 2 x 2, 256^2 to 4096^2 pixels, pixels
# normalized to [-1, 1].
QWEN_MIN_PIXELS = 256 * 256
QWEN_MAX_PIXELS = 4096 * 4096
QWEN_MEAN = (0.5, 0.5, 0.5)
QWEN_STD = (0.5, 0.5, 0.5)


@lru_cache(maxsize=4096)
def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) in pixels the processor resizes an image of `height` x `width` to: both multiples of
    `factor`, the area within [min_pixels, max_pixels] where rounding allows, the aspect ratio kept as closely as
    possible. Python's `round` (half to even) as the processor's."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image {height}x{width}: aspect ratio {max(height, width) / min(height, width):.1f} is "
                         f"over {MAX_ASPECT_RATIO}, which the Qwen processor refuses")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify(image: torch.Tensor, patch_size: int, merge_size: int, temporal_patch_size: int) -> torch.Tensor:
    """`[C, H, W]` (H, W multiples of patch_size * merge_size) -> `[(H/P) * (W/P), C * T * P * P]`: rows in
    merge-block order, each `(c, t, y, x)` with the image repeated over the T frames (the processor's layout)."""
    c, h, w = image.shape
    factor = patch_size * merge_size
    if h % factor or w % factor:
        raise ValueError(f"image {h}x{w} is not a multiple of patch_size * merge_size = {factor}")
    gh, gw = h // patch_size, w // patch_size
    m, p = merge_size, patch_size
    x = image.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)  # (bh, bw, mh, mw, c, y, x)
    x = x.unsqueeze(5).expand(*x.shape[:5], temporal_patch_size, p, p)
    return x.reshape(gh * gw, c * temporal_patch_size * p * p)


def unpatchify(rows: torch.Tensor, grid: tuple[int, int], channels: int, patch_size: int, merge_size: int,
               temporal_patch_size: int) -> torch.Tensor:
    """The inverse of `patchify` for one image: `[grid_h * grid_w, C*T*P*P]` -> `[C, H, W]` (the first frame)."""
    gh, gw = grid
    m, p = merge_size, patch_size
    x = rows.reshape(gh // m, gw // m, m, m, channels, temporal_patch_size, p, p)[:, :, :, :, :, 0]
    return x.permute(4, 0, 2, 5, 1, 3, 6).reshape(channels, gh * p, gw * p)


def llm_grid_thw(grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """The tower's `grid_thw` (patches) -> the grid of LLM tokens each image or video gives, `(t, h / m, w / m)`:
    what the LLM's 3-D (multimodal RoPE) positions of its placeholders follow."""
    grid = torch.as_tensor(grid_thw).clone()
    grid[..., 1:] //= merge_size
    return grid


def _resize_like_processor(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """A float `[C, H, W]` image in [0, 1] resized as the processor resizes the uint8 image it decodes: rounded to
    8-bit levels, then torch's bicubic antialiased resize of uint8 images (what torchvision calls; its integer
    two-pass arithmetic rounds between the passes, so a float resize differs by up to 16 levels when enlarging).
    Back in [0, 1]."""
    levels = (image.clamp(0, 1) * 255).round().to(torch.uint8)
    if tuple(image.shape[-2:]) != (height, width):
        if levels.device.type == "cpu":
            levels = F.interpolate(levels[None], size=(height, width), mode="bicubic", antialias=True)[0]
        else:  # no uint8 kernel off the CPU: the float resize, rounded
            levels = F.interpolate(levels[None].float(), size=(height, width), mode="bicubic",
                                   antialias=True)[0].clamp(0, 255).round()
    return levels.float() / 255


@dataclass
class GridImage:
    """One processed image: `pixels [grid_h * grid_w, C*T*P*P]`, its patch grid, placeholders and resized size."""

    pixels: torch.Tensor
    grid: tuple[int, int]  # (grid_h, grid_w) in patches
    num_tokens: int  # LLM tokens (placeholders) after the patch merger
    size: tuple[int, int]  # (height, width) in pixels after resizing

    @property
    def encoder_patches(self) -> list[int]:
        """The patches of each sequence the tower attends within: the image's own grid (what its FLOPs follow)."""
        return [self.grid[0] * self.grid[1]]

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        return (1, *self.grid)


@dataclass(frozen=True)
class GridImages:
    """The Qwen processor's images as a mimo image mode. The encoder input of a micro-batch is
    `{"pixel_values": [total_patches, C*T*P*P], "grid_thw": LongTensor[N, 3]}` (transformers' names), the images
    one after another; the tower attends within each image.

    `quantize`: resize the image as 8-bit levels, as the processor resizes the uint8 images it decodes (then its
    pixel values equal the processor's); False: a float resize of the float image (no rounding; it differs from
    the processor's by a few levels where bicubic overshoots)."""

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = QWEN_MIN_PIXELS
    max_pixels: int = QWEN_MAX_PIXELS
    mean: tuple[float, ...] = QWEN_MEAN
    std: tuple[float, ...] = QWEN_STD
    quantize: bool = True
    kind: Literal["grid_thw"] = field(default="grid_thw", init=False)

    def __post_init__(self):
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} is over max_pixels {self.max_pixels}")
        if self.max_pixels < self.factor ** 2:
            raise ValueError(f"max_pixels {self.max_pixels} is below one merged patch ({self.factor}^2 pixels)")
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ValueError(f"mean and std need 3 values each, std positive; got {self.mean}, {self.std}")

    @property
    def factor(self) -> int:
        """Each side of a resized image is a multiple of this many pixels (one merged patch)."""
        return self.patch_size * self.merge_size

    @property
    def row_size(self) -> int:
        """Values per patch row: 3 channels x temporal patch x patch^2."""
        return 3 * self.temporal_patch_size * self.patch_size ** 2

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(int(height), int(width), self.factor, self.min_pixels, self.max_pixels)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(grid_h, grid_w) in patches for an image of `height` x `width` pixels."""
        h, w = self.resized_size(height, width)
        return h // self.patch_size, w // self.patch_size

    def num_patches(self, height: int, width: int) -> int:
        """Patches the tower reads for an image (before the merger)."""
        gh, gw = self.grid(height, width)
        return gh * gw

    def num_tokens(self, height: int, width: int) -> int:
        return self.num_patches(height, width) // self.merge_size ** 2

    def process(self, image: torch.Tensor) -> GridImage:
        """A float `[3, H, W]` image in [0, 1] (mimo's decoded images) -> its rows for the tower."""
        h, w = self.resized_size(image.shape[-2], image.shape[-1])
        resized = _resize_like_processor(image.float(), h, w) if self.quantize else \
            F.interpolate(image.float()[None], size=(h, w), mode="bicubic", antialias=True)[0].clamp(0, 1)
        mean = torch.tensor(self.mean, dtype=torch.float32).view(-1, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32).view(-1, 1, 1)
        pixels = patchify((resized - mean) / std, self.patch_size, self.merge_size, self.temporal_patch_size)
        grid = (h // self.patch_size, w // self.patch_size)
        return GridImage(pixels=pixels, grid=grid, num_tokens=grid[0] * grid[1] // self.merge_size ** 2,
                         size=(h, w))

    def collate(self, images: Sequence[GridImage]) -> dict:
        return {"pixel_values": torch.cat([p.pixels for p in images], dim=0),
                "grid_thw": torch.tensor([p.grid_thw for p in images], dtype=torch.long).reshape(len(images), 3)}

    @staticmethod
    def concat(inputs: Sequence[dict]) -> dict:
        """Several collated encoder inputs as one: the images one after another. The tower's output for it is the
        outputs for `inputs` concatenated (it attends within each image)."""
        return {"pixel_values": torch.cat([i["pixel_values"] for i in inputs], dim=0),
                "grid_thw": torch.cat([i["grid_thw"] for i in inputs], dim=0)}
