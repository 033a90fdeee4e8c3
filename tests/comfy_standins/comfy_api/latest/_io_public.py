from ._io import *  # noqa: F401,F403
from ._io import Autogrow, DynamicCombo, DynamicInput, Hidden, HiddenHolder, create_input_dict_v1  # noqa: F401
