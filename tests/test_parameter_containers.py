"""nn.ParameterList and nn.ParameterDict against torch's: the names their parameters are
registered under, list and dict behaviour, printed form, state_dict round trips with torch,
and gradients reaching the parameters they hold."""
import numpy as np
import pytest

import microtensor as mt
from microtensor import nn

torch = pytest.importorskip("torch")


def pairs(*shapes):
    """Matching (torch, microtensor) parameters of the given shapes and values."""
    arrays = [np.random.randn(*s) for s in shapes]
    return ([torch.nn.Parameter(torch.tensor(a)) for a in arrays],
            [nn.Parameter(mt.tensor(a)) for a in arrays])


class Holder(nn.Module):
    def __init__(self, plist, pdict):
        super().__init__()
        self.weights = plist
        self.extra = pdict

    def forward(self, x):
        for w in self.weights:
            x = x @ w
        return x * self.extra["scale"] + self.extra["shift"]


class TorchHolder(torch.nn.Module):
    def __init__(self, plist, pdict):
        super().__init__()
        self.weights = plist
        self.extra = pdict

    def forward(self, x):
        for w in self.weights:
            x = x @ w
        return x * self.extra["scale"] + self.extra["shift"]


def test_parameter_list_registers_as_torch():
    tp, mp = pairs((3, 4), (4, 2), (2,))
    t, m = torch.nn.ParameterList(tp[:2]), nn.ParameterList(mp[:2])
    t.append(tp[2]), m.append(mp[2])
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in t.named_parameters()] == \
        ["0", "1", "2"]
    assert len(m) == len(t) == 3
    assert m[0] is mp[0] and m[-1] is mp[2] and list(m) == mp
    sliced = m[1:]
    assert isinstance(sliced, nn.ParameterList) and list(sliced) == mp[1:]
    assert [n for n, _ in sliced.named_parameters()] == ["0", "1"]
    assert list(m[::2]) == [mp[0], mp[2]]
    m[1] = mt.ones(5)                              # a plain tensor becomes a Parameter
    assert isinstance(m[1], nn.Parameter) and m[1].requires_grad and m[1].shape == (5,)
    m += [mt.zeros(2)]
    m.extend(nn.ParameterList([mt.zeros(1)]))
    assert len(m) == 5 and isinstance(m[4], nn.Parameter)
    assert len(list(m.parameters())) == 5
    with pytest.raises(IndexError):
        m[5]
    with pytest.raises(IndexError):
        m[-6] = mt.zeros(1)
    with pytest.raises(TypeError, match="iterable"):
        m.extend(mt.zeros(3))
    with pytest.raises(TypeError, match="iterable"):
        m.extend(3)
    with pytest.raises(RuntimeError, match="should not be called"):
        m(1)


def test_parameter_list_repr_as_torch():
    tp, mp = pairs((3, 4), (2,))
    t, m = torch.nn.ParameterList(tp), nn.ParameterList(mp)
    # torch prints torch.float64; everything else is torch's text
    assert repr(m) == repr(t).replace("torch.", "mt.")
    assert repr(nn.ParameterList()) == "ParameterList()"


def test_parameter_dict_as_torch():
    tp, mp = pairs((2,), (3,), (4,))
    # a plain dict: sorted keys (torch's rule); an OrderedDict or pairs: their own order
    t = torch.nn.ParameterDict({"b": tp[0], "a": tp[1]})
    m = nn.ParameterDict({"b": mp[0], "a": mp[1]})
    assert list(m) == list(t) == ["a", "b"]
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in t.named_parameters()]
    m2 = nn.ParameterDict([("b", mp[0]), ("a", mp[1])])
    assert list(m2.keys()) == ["b", "a"]
    assert m["a"] is mp[1] and "a" in m and "z" not in m and len(m) == 2
    assert list(m.values()) == [mp[1], mp[0]] and list(m.items()) == [("a", mp[1]), ("b", mp[0])]
    assert m.get("z") is None and m.get("a") is mp[1]
    m["c"] = mt.ones(4)                            # a plain tensor becomes a Parameter
    assert isinstance(m["c"], nn.Parameter) and m.c is m["c"]
    assert m.setdefault("c", mp[2]) is m["c"] and m.setdefault("d", mp[2]) is mp[2]
    assert m.pop("d") is mp[2] and "d" not in m
    assert "d" not in dict(m.named_parameters())
    key, value = m.popitem()
    assert key == "c" and list(m) == ["a", "b"]
    both = m | nn.ParameterDict({"z": mp[2]})
    assert list(both) == ["a", "b", "z"] and list(m) == ["a", "b"]
    m |= {"y": mp[2]}
    assert list(m) == ["a", "b", "y"]
    copy = m.copy()
    assert copy is not m and copy["a"] is m["a"]
    fresh = m.fromkeys(["p", "q"], mt.zeros(1))
    assert list(fresh) == ["p", "q"]
    del m["y"]
    assert list(m) == ["a", "b"] and len(list(m.parameters())) == 2
    assert list(reversed(m)) == ["b", "a"]
    m.clear()
    assert len(m) == 0 and not list(m.parameters())
    with pytest.raises(KeyError):
        m["a"]
    with pytest.raises(KeyError):
        del m["a"]
    with pytest.raises(KeyError):
        m.popitem()
    with pytest.raises(TypeError, match="not a string"):
        m[0] = mt.zeros(1)
    with pytest.raises(KeyError, match=r"\."):
        m["a.b"] = mt.zeros(1)
    assert "a.b" not in m                          # a refused name is not kept
    with pytest.raises(ValueError, match="length 3"):
        m.update([("a", mt.zeros(1), 3)])
    with pytest.raises(TypeError, match="should be Iterable"):
        m.update([5])
    with pytest.raises(RuntimeError, match="should not be called"):
        m()


def test_parameter_dict_repr_as_torch():
    tp, mp = pairs((3, 4), (2,))
    t = torch.nn.ParameterDict({"w": tp[0], "b": tp[1]})
    m = nn.ParameterDict({"w": mp[0], "b": mp[1]})
    # torch's ParameterDict names the tensor type (torch.DoubleTensor) where its
    # ParameterList names the dtype; microtensor has no tensor types, so both name the dtype
    assert repr(m) == repr(t).replace("torch.DoubleTensor", "mt.float64")
    assert "(w): Parameter containing: [mt.float64 of size 3x4]" in repr(m)


def test_torch_state_dict_loads_and_gives_torchs_gradients():
    tp, _ = pairs((3, 4), (4, 2), (2,), (2,))
    t = TorchHolder(torch.nn.ParameterList(tp[:2]),
                    torch.nn.ParameterDict({"scale": tp[2], "shift": tp[3]}))
    m = Holder(nn.ParameterList([mt.zeros(3, 4), mt.zeros(4, 2)]),
               nn.ParameterDict({"scale": mt.zeros(2), "shift": mt.zeros(2)}))
    sd = t.state_dict()
    assert list(m.state_dict()) == list(sd) == ["weights.0", "weights.1", "extra.scale",
                                                "extra.shift"]
    m.double().load_state_dict({k: v.numpy() for k, v in sd.items()})
    x = np.random.randn(5, 3)
    g = np.random.randn(5, 2)
    ty = t(torch.tensor(x))
    my = m(mt.tensor(x))
    np.testing.assert_allclose(my.numpy(), ty.detach().numpy(), rtol=1e-12)
    ty.backward(torch.tensor(g))
    my.backward(mt.tensor(g))
    for (name, tparam), (mname, mparam) in zip(t.named_parameters(), m.named_parameters()):
        assert name == mname
        np.testing.assert_allclose(mparam.grad.numpy(), tparam.grad.numpy(), rtol=1e-12)
    # an optimizer sees them
    opt = mt.optim.SGD(m.parameters(), lr=0.1)
    before = m.weights[0].numpy().copy()
    opt.step()
    assert not np.allclose(m.weights[0].numpy(), before)
