"""Video clips into the pool (docs/video.md): only the clip's frames decoded, each written
through the fused kernel straight into its row of the batch slot, clips that resume exactly.

Install with ``pip install 'pooled-loader[video]'`` (PyAV, which ships its own FFmpeg).
Modules: ``sources`` (folders, lists, shards), ``container`` (a file opened, checked and decoded
under bounds), ``transform`` (a torchvision ``Compose`` on a video read into fused steps),
``dataset`` (:class:`VideoClips`). PyAV is imported when the first clip is decoded.
"""
from __future__ import annotations

from .dataset import VideoClips
from .sources import VIDEO_EXTENSIONS

__all__ = ["VideoClips", "VIDEO_EXTENSIONS"]
