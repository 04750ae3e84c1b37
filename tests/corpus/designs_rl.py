"""Canonical reinforcement-learning designs: DQN with a target network, REINFORCE, PPO.

The environment is a small chain written in torch (seeded), so the loops are the recipes' own:
roll out with the current policy, then update.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from _designs import gen
from _harness import Built, Program
from torch import nn
from torch.distributions import Categorical

N_STATES, N_ACTIONS = 6, 2


class Chain:
    """A 6-state chain: action 1 moves right, 0 left; the right end pays 1 and ends."""

    def __init__(self, seed: int) -> None:
        self.g = gen(seed)
        self.s = 0

    @staticmethod
    def obs(s: int) -> torch.Tensor:
        return F.one_hot(torch.tensor(s), N_STATES).float()

    def reset(self) -> torch.Tensor:
        self.s = int(torch.randint(0, N_STATES - 1, (1,), generator=self.g))
        return self.obs(self.s)

    def step(self, a: int) -> tuple[torch.Tensor, float, bool]:
        if torch.rand(1, generator=self.g) < 0.1:  # a slippery chain
            a = 1 - a
        self.s = max(0, min(N_STATES - 1, self.s + (1 if a == 1 else -1)))
        done = self.s == N_STATES - 1
        return self.obs(self.s), (1.0 if done else -0.01), done


def _net(out: int = N_ACTIONS) -> nn.Sequential:
    return nn.Sequential(nn.Linear(N_STATES, 32), nn.ReLU(), nn.Linear(32, out))


def _dqn() -> Built:
    policy_net, target_net = _net(), _net()  # the PyTorch DQN tutorial's two networks
    target_net.load_state_dict(policy_net.state_dict())
    opt = torch.optim.AdamW(policy_net.parameters(), lr=1e-3, amsgrad=True)
    gamma, tau = 0.99, 0.005
    env, g = Chain(0), gen(1)
    memory: list[tuple[torch.Tensor, int, float, torch.Tensor, bool]] = []
    s = env.reset()
    for _ in range(64):  # a replay memory filled by a random policy first
        a = int(torch.randint(0, N_ACTIONS, (1,), generator=g))
        s2, r, done = env.step(a)
        memory.append((s, a, r, s2, done))
        s = env.reset() if done else s2
    batches = []
    for _ in range(4):
        idx = torch.randint(0, len(memory), (16,), generator=g).tolist()
        b = [memory[k] for k in idx]
        batches.append((
            torch.stack([t[0] for t in b]), torch.tensor([t[1] for t in b]),
            torch.tensor([t[2] for t in b]), torch.stack([t[3] for t in b]),
            torch.tensor([t[4] for t in b]),
        ))  # fmt: skip

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        states, actions, rewards, next_states, dones = batch
        q = model(states).gather(1, actions[:, None]).squeeze(1)
        with torch.no_grad():
            next_q = target_net(next_states).max(1).values * (~dones).float()
        return F.smooth_l1_loss(q, rewards + gamma * next_q)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        loss = loss_fn(model, batch)  # optimize_model()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 100)
        opt.step()
        target_sd, policy_sd = target_net.state_dict(), model.state_dict()
        for key in policy_sd:  # soft update of the target network's weights
            target_sd[key] = policy_sd[key] * tau + target_sd[key] * (1 - tau)
        target_net.load_state_dict(target_sd)

    return Built(policy_net, opt, batches, step, loss_fn, probe_optimizer=opt)


def _reinforce() -> Built:
    policy = nn.Sequential(nn.Linear(N_STATES, 32), nn.Dropout(0.2), nn.ReLU(),
                           nn.Linear(32, N_ACTIONS))  # fmt: skip
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    env, gamma = Chain(2), 0.99

    def step(model: nn.Module, opt: Any, episode: Any, i: int) -> None:
        # pytorch/examples reinforcement_learning/reinforce.py: one episode, then finish_episode()
        state, log_probs, rewards = env.reset(), [], []
        for _ in range(12):
            m = Categorical(logits=model(state[None]))
            action = m.sample()
            log_probs.append(m.log_prob(action))
            state, reward, done = env.step(int(action))
            rewards.append(reward)
            if done:
                break
        returns, acc = [], 0.0
        for r in reversed(rewards):
            acc = r + gamma * acc
            returns.insert(0, acc)
        ret = torch.tensor(returns)
        ret = (ret - ret.mean()) / (ret.std() + 1e-8) if len(ret) > 1 else ret
        loss = torch.cat([-lp * r for lp, r in zip(log_probs, ret)]).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Built(policy, opt, list(range(6)), step)


class ActorCritic(nn.Module):
    """CleanRL ppo.py Agent: separate actor and critic MLPs (tanh)."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(N_STATES, 32), nn.Tanh(), nn.Linear(32, 1))
        self.actor = nn.Sequential(nn.Linear(N_STATES, 32), nn.Tanh(), nn.Linear(32, N_ACTIONS))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor(x), self.critic(x).squeeze(-1)


def _rollout(model: nn.Module, env: Chain, n: int, gamma: float = 0.99, lam: float = 0.95) -> Any:
    obs, acts, logps, rews, dones, vals = [], [], [], [], [], []
    s = env.reset()
    with torch.no_grad():
        for _ in range(n):
            logits, v = model(s[None])
            dist = Categorical(logits=logits)
            a = dist.sample()
            s2, r, d = env.step(int(a))
            obs.append(s), acts.append(a[0]), logps.append(dist.log_prob(a)[0])
            rews.append(r), dones.append(d), vals.append(v[0])
            s = env.reset() if d else s2
        next_v = model(s[None])[1][0]
    adv, last = torch.zeros(n), torch.tensor(0.0)
    for t in reversed(range(n)):  # generalised advantage estimation
        nv = next_v if t == n - 1 else vals[t + 1]
        nonterminal = 0.0 if dones[t] else 1.0
        delta = rews[t] + gamma * nv * nonterminal - vals[t]
        last = delta + gamma * lam * nonterminal * last
        adv[t] = last
    values = torch.stack(vals)
    return torch.stack(obs), torch.stack(acts), torch.stack(logps), adv, adv + values


def _ppo_loss(model: nn.Module, mb: Any) -> torch.Tensor:
    obs, acts, old_logp, adv, returns = mb
    logits, v = model(obs)
    dist = Categorical(logits=logits)
    ratio = (dist.log_prob(acts) - old_logp).exp()
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
    v_loss = 0.5 * ((v - returns) ** 2).mean()
    return pg_loss - 0.01 * dist.entropy().mean() + 0.5 * v_loss


def _ppo() -> Built:
    model = ActorCritic()
    opt = torch.optim.Adam(model.parameters(), lr=2.5e-4, eps=1e-5)
    torch.manual_seed(3)
    rollout = _rollout(model, Chain(3), 32)
    g = gen(4)
    minibatches = []
    for _epoch in range(2):  # update epochs over shuffled minibatches of one rollout
        perm = torch.randperm(32, generator=g)
        for k in range(0, 32, 16):
            minibatches.append(tuple(t[perm[k : k + 16]] for t in rollout))

    def step(model: nn.Module, opt: Any, mb: Any, i: int) -> None:
        loss = _ppo_loss(model, mb)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()

    return Built(model, opt, minibatches, step, _ppo_loss, probe_optimizer=opt)


def _ddpg() -> Built:
    """Lillicrap et al. 2016 / Fujimoto's TD3 repo DDPG.py: the actor's loss runs through the
    critic, whose gradients from it are discarded by the critic's next zero_grad()."""
    actor = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 1), nn.Tanh())
    critic = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
    actor_t, critic_t = copy.deepcopy(actor), copy.deepcopy(critic)
    actor_opt = torch.optim.Adam(actor.parameters(), lr=1e-4)
    critic_opt = torch.optim.Adam(critic.parameters(), lr=1e-3, weight_decay=1e-2)
    g, gamma, tau = gen(5), 0.99, 0.005
    batches = []
    for _ in range(4):  # replay samples of a 1-d control task: reward -(s + a)^2
        s = torch.randn(16, 3, generator=g)
        a = torch.rand(16, 1, generator=g) * 2 - 1
        r = -((s[:, :1] + a) ** 2)
        batches.append((s, a, r, s + 0.1 * a.repeat(1, 3), torch.zeros(16, 1)))

    def step(models: Any, opts: Any, batch: Any, i: int) -> None:
        s, a, r, s2, done = batch
        with torch.no_grad():
            target_q = r + gamma * (1 - done) * critic_t(torch.cat([s2, actor_t(s2)], 1))
        critic_loss = F.mse_loss(critic(torch.cat([s, a], 1)), target_q)
        critic_opt.zero_grad()
        critic_loss.backward()
        critic_opt.step()
        actor_loss = -critic(torch.cat([s, actor(s)], 1)).mean()
        actor_opt.zero_grad()
        actor_loss.backward()
        actor_opt.step()
        with torch.no_grad():
            for net, tgt in ((critic, critic_t), (actor, actor_t)):
                for p, tp in zip(net.parameters(), tgt.parameters()):
                    tp.data.copy_(tau * p.data + (1 - tau) * tp.data)

    models = {"actor": actor, "critic": critic}
    return Built(models, {"actor": actor_opt, "critic": critic_opt}, batches, step)


PROGRAMS = [
    Program("dqn_target_net", "dqn", _dqn,
            "Mnih et al. 2015 DQN; PyTorch reinforcement Q-learning tutorial (soft target update)"),
    Program("reinforce", "policy gradient", _reinforce,
            "Williams 1992; pytorch/examples reinforcement_learning/reinforce.py"),
    Program("ppo_clip_gae", "policy gradient", _ppo,
            "Schulman et al. 2017 PPO; vwxyzjn/cleanrl ppo.py (GAE, clipped ratio, value, entropy)"),
    Program("ddpg_actor_through_critic", "actor-critic", _ddpg,
            "Lillicrap et al. 2016 DDPG; sfujim/TD3 DDPG.py (soft targets, actor loss via critic)"),
]  # fmt: skip
