#pragma once
/// \file splitgrad.h
/// The splitgrad C++ API: linear layers whose weight gradient can be deferred to backward_dw(),
/// with gradients that equal plain autograd's for any tying, reuse, micro-batching and order.
#include "splitgrad/deferred.h"
#include "splitgrad/grouped_linear.h"
#include "splitgrad/layernorm.h"
#include "splitgrad/linear.h"
#include "splitgrad/module.h"
#include "splitgrad/ops.h"
#include "splitgrad/optim.h"
