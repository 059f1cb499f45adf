"""``python -m user_dir`` prints this package's directory: the value of fairseq's ``--user-dir``
for an installed (not checked-out) copy, e.g. ``fairseq-train --user-dir "$(python -m user_dir)"``."""

import os

import user_dir

print(os.path.dirname(os.path.abspath(user_dir.__file__)))
