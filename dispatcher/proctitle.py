"""Process titles (``batchyard::dispatcher``, ``batchyard::amx-worker[w0]``) for ps/top/systemd."""


def set_title(title: str) -> None:
    try:
        import setproctitle
    except ImportError:  # cosmetic only: never fail a process over its title
        return
    setproctitle.setproctitle(title)
