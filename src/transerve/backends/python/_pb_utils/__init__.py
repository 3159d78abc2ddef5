"""The parts of `triton_python_backend_utils` (the module models import as `pb_utils`), one job each; models
import the facade, which re-exports them, never these modules."""
