"""Answer grading, shared by data, rewards and evaluation: extraction and notation
(``answers``), comparison (``verify``) and accuracy (``accuracy``)."""
