"""Package attributes imported on first use (PEP 562), shared by the packages that export names
lazily (arr_coc, pipeline, pipeline.vlm): importing the package stays light."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, homes: dict[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(__getattr__, __dir__) for `package`: name -> the submodule (relative to it) that defines it;
    a name is imported once, then cached in the package's `namespace` (its globals())."""
    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(homes))
    return __getattr__, __dir__
