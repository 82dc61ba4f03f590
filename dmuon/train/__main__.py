"""``python -m dmuon.train``: see :mod:`dmuon.train.launch` for the options."""

from dmuon.train.launch import main

if __name__ == "__main__":
    main()
