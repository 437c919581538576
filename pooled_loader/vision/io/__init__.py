"""Image input and output, below every op: the bytes of a file in a reused buffer, the JPEG
frame header from its markers, the decoders and the resize kernels.

- ``buffers``: per-thread scratch memory and ``read_file`` into it;
- ``jpeg_markers``: a JPEG's frame header and scan count, read from its markers (no imports);
- ``decode``: ``DecodeImage`` and the crop decoders (the compiled region-of-interest decoder
  ``pooled_loader.vision._jpeg``, or simplejpeg);
- ``kernels``: the fused crop -> resize -> flip -> CHW step (the compiled
  ``pooled_loader.vision._kernels``, or OpenCV: the only module that imports cv2, lazily).

The two compiled extensions stay where setup.py builds them, in ``pooled_loader.vision``.
Imports: numpy, core/ and those extensions; nothing else of vision/. Nothing is imported here:
import the module you need (``from pooled_loader.vision.io import decode``).
"""
__all__ = ["buffers", "decode", "jpeg_markers", "kernels"]
