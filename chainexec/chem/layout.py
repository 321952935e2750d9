"""The datasets of the input files :mod:`chainexec.chem.bridge` writes, with their index letters.

Kept apart from the bridge (which imports NumPy, h5py and PySCF) so that ``chainexec chem`` can
check a config template against them before it imports or computes anything.
"""

#: The (T) inputs: dataset -> index letters (occupied: i j k m; virtual: a b c f).
INDICES = {
    "t1": "ia",
    "t2": "ijab",
    "ovvv": "iabc",
    "ovoo": "iajk",
    "ovov": "iajb",
    "e_occ": "i",
    "e_vir": "a",
    "f_vo": "ai",
}

#: The synthetic (T) inputs made whole in memory before they are written; ``ovvv``, o·v³ elements
#: and the largest by far, is made and written in blocks (:func:`chainexec.chem.bridge.synthetic_inputs`).
SYNTHETIC_IN_MEMORY = ("t1", "t2", "ovoo", "ovov", "e_occ", "e_vir", "f_vo")

#: The four-index transform's inputs: AO integrals (AO: p q r s) and MO coefficients (MO: a).
AO2MO_INDICES = {"A": "pqrs", "C": "pa"}
