"""The config machinery, a leaf of the package: ``setting()`` declares a field in the section of the code that
reads it, a coercer per kind of field reads one value, YAML is read as fdam reads it, and credentials never show."""
