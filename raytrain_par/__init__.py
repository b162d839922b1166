"""raytrain-par: compare ways of parallelising deep-learning training on a Ray cluster."""

__version__ = "0.1.0"
