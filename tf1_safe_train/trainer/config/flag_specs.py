"""Each parameter of a binary declared once: its flag type, default and help.

A `TrainParams` field carries its flag in the field's metadata (`param`);
a flag that is no field (the cluster's) is a `FlagSpec` of its own. From
these the binary defines its absl flags and the docs' flags table is
generated (`markdown_table`; tests/readme_test.py fails when the docs and
the flags differ). This module imports neither absl nor TensorFlow.
"""

import dataclasses

_KINDS = {str: "string", int: "integer", float: "float", bool: "boolean"}
_SAME = object()  # The flag's default is the field's.


@dataclasses.dataclass(frozen=True)
class FlagSpec(object):
  """One flag: `kind` names its absl `DEFINE_<kind>` function.

  Attributes:
    name: the flag's name, without dashes.
    kind: 'string', 'enum', 'integer', 'float' or 'boolean'.
    default: the flag's default (None: decided at run time, see `help`).
    help: the help text `--helpfull` prints.
    choices: the values of an enum flag.
    doc_default: the default as the docs' table shows it, for a default
      that depends on the machine (e.g. 'every GPU, or 2').
  """
  name: str
  kind: str
  default: object
  help: str
  choices: tuple = ()
  doc_default: str = None

  def definition(self):
    """(name of the absl DEFINE function, its positional arguments)."""
    if self.kind == "enum":
      return "DEFINE_enum", (self.name, self.default, list(self.choices),
                             self.help)
    return "DEFINE_" + self.kind, (self.name, self.default, self.help)


def param(default, help_text, choices=(), flag_default=_SAME,
          flag_choices=None, doc_default=None):
  """A dataclass field whose metadata declares its flag.

  Args:
    default: the field's default.
    help_text: the flag's help.
    choices: the valid values of a string field (its flag is an enum).
    flag_default: the flag's default when it differs from the field's
      (e.g. None for a default resolved at run time).
    flag_choices: the flag's values when they differ from `choices` (e.g.
      with 'auto' resolved at run time).
    doc_default: the default as the docs show it, for such flags.

  Returns:
    A `dataclasses.field`.
  """
  return dataclasses.field(default=default, metadata={
      "help": help_text, "choices": tuple(choices),
      "flag_default": default if flag_default is _SAME else flag_default,
      "flag_choices": tuple(choices if flag_choices is None else flag_choices),
      "doc_default": doc_default})


def of_params(params_class):
  """The `FlagSpec` of every field of `params_class` declared with `param`."""
  specs = []
  for field in dataclasses.fields(params_class):
    meta = field.metadata
    if "help" not in meta:
      continue
    kind = "enum" if meta["flag_choices"] else _KINDS[field.type]
    specs.append(FlagSpec(field.name, kind, meta["flag_default"],
                          meta["help"], meta["flag_choices"],
                          meta["doc_default"]))
  return tuple(specs)


def flag_values(params_class, parsed_flags):
  """{field name: its flag's value} for the flag fields of `params_class`."""
  return {spec.name: getattr(parsed_flags, spec.name)
          for spec in of_params(params_class)}


def _format_default(spec):
  if spec.doc_default is not None:
    return spec.doc_default
  value = spec.default
  if isinstance(value, bool):
    return "`%s`" % str(value).lower()
  if isinstance(value, float):
    return "`%g`" % value
  if value == "":
    return ""
  return "`%s`" % (value,)


def markdown_table(specs):
  """The docs' table of `specs`: flag, default, meaning (the help text)."""
  lines = ["| flag | default | meaning |", "| --- | --- | --- |"]
  for spec in specs:
    meaning = spec.help
    if spec.kind == "enum":
      meaning += " One of: %s." % ", ".join("`%s`" % c for c in spec.choices)
    lines.append("| `--%s` | %s | %s |" % (spec.name, _format_default(spec),
                                          meaning.replace("|", "\\|")))
  return "\n".join(lines) + "\n"
