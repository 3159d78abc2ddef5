"""Python-backend model files that `transerve export` copies into a repository as they are.

They run inside a python-backend worker (transerve's or Triton's), so they import nothing from transerve:
only numpy, `tokenizers` and `triton_python_backend_utils`.
"""
