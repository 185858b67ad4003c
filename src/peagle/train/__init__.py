"""Training engine of the P-EAGLE draft (speculators-peagle.md §3)."""
from .cod import CodElements, cod_depth_size, sample_cod
from .elements import Elements, ShiftedRow, build_elements, sample_elements, shift_row

__all__ = [
    "CodElements", "Elements", "ShiftedRow", "build_elements", "cod_depth_size", "sample_cod",
    "sample_elements", "shift_row",
]
