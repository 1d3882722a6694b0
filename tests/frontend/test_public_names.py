"""``dir(pypm_jax)`` shows the public API, not the helpers the facade imports."""

import pypm_jax as pm


def test_dir_is_the_public_api():
    names = dir(pm)
    assert names == sorted(pm.__all__)
    for helper in ("Any", "Iterable", "Iterator", "Sequence", "annotations", "RuleDef"):
        assert helper not in names
    for public in ("op", "pattern", "rule", "match", "rewrite", "serialize", "PyPMError"):
        assert public in names
    assert all(hasattr(pm, n) for n in pm.__all__)
