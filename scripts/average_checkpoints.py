#!/usr/bin/env python3
"""Average the model parameters of the last N epoch checkpoints of a fairseq run.

Same as the console command ``latent-average-checkpoints``
(the code and its documentation: ``user_dir.average_checkpoints``).
"""

from user_dir.average_checkpoints import main

if __name__ == "__main__":
    raise SystemExit(main())
