"""TensorRT engines of exported graphs: :func:`build_engines` (``m2export build``) and :func:`load_engine`.

TensorRT and Polygraphy's TensorRT backend are imported only when a build runs.
"""

from m2export.trt.build import BuildResult, ShapeRange, build_engines, load_engine

__all__ = ["BuildResult", "ShapeRange", "build_engines", "load_engine"]
