"""Class helpers."""


def retrieve_all_subclasses(cls) -> list:
    """Every subclass of cls, depth first."""
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(retrieve_all_subclasses(sub))
    return out
