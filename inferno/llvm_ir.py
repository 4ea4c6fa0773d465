"""Small builders for the hand-written LLVM IR of our intrinsics (inferno.nibble_dots, inferno.kv.vectors,
inferno.kernels): vector constants, a typed pointer into an array, a scalar splatted across a vector, an
LLVM intrinsic function declared once per module."""

from __future__ import annotations

from llvmlite import ir

_INT = ir.IntType(32)


def constant(element: ir.Type, values: list[int] | list[float]) -> ir.Constant:
    """A vector constant of `element`s."""
    return ir.Constant(ir.VectorType(element, len(values)), values)


def pointer(context, builder, array_type, array, offset, element: ir.Type) -> ir.Value:
    """Address of the array's flat element `offset` as a pointer to `element` (any alignment)."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [offset]), element.as_pointer())


def splat(builder, value: ir.Value, lanes: int) -> ir.Value:
    """`value` in every one of `lanes` lanes."""
    vector = ir.VectorType(value.type, lanes)
    first = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(_INT, 0))
    return builder.shuffle_vector(first, first, constant(_INT, [0] * lanes))


def declared(module: ir.Module, name: str, function_type: ir.FunctionType) -> ir.Function:
    """The function `name` of the module (an LLVM intrinsic such as llvm.prefetch.p0), declared on
    first use."""
    return module.globals.get(name) or ir.Function(module, function_type, name)
