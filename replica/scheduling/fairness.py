"""Fair admission across tenants: a virtual token counter per tenant around any admission
policy (`QueuePolicy`), so that one tenant's queued flood does not delay another tenant's
requests, while each tenant's own requests keep the policy's order (FIFO, SJF, Chameleon).

The counters follow VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI
'24; its reference implementation is `VTCReqQueue` in Ying1123/VTC-artifact,
slora/server/router/vtc_req_queue.py):

- a tenant's counter grows by the service it gets: `input_weight` per prompt token when a
  request is admitted (`generate_new_batch`), `output_weight` per generated token
  (`update_counter`; 1 and 2 there, as here);
- admission goes to the tenant with the smallest counter among those with waiting requests,
  one request at a time (`generate_new_batch`);
- a tenant whose queue was empty is lifted to the smallest counter of the tenants waiting
  (`append`), so time spent idle is not credit to flood with later.

Where VTC stops admitting at the first request that does not fit, here a tenant whose
policy admits nothing now (its adapter is loading, its head does not fit its quota) drops
out of this step's turn and the others go on; a full batch (`Admit.FULL`) ends the step for
all. With one tenant waiting, its policy admits as it would alone.

Counters order admission, but a slot is only admitted to once it is free: a tenant whose
requests run long (ignore_eos streams) would keep every slot it took while alone, and a
second tenant's request would wait for one of them to end. So, given the batch's `slots`
(the scheduler's `max_num_seqs`), a full batch gives slots back: while a waiting tenant
holds fewer than its share (`slots // tenants with work`) and its counter is below that of
a tenant holding more than its share (so admission takes it first), the latter's running
request with the least computed (the cheapest to recompute) is preempted before the step's
admission, as many as the waiting request needs to fit (`room`), one request per waiting
tenant and step. A tenant's request thus starts within a step or two whatever the others
have running or queued, and a tenant alone still fills the batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable

from loraplex.replica.scheduling.policy import Admit, QueuePolicy, Room, TryAdmit
from loraplex.replica.sequence import SeqStatus, Sequence

Tenant = Hashable  # a tenant's name, or None for requests that name none


class TenantFair:
    """A `QueuePolicy`: one `make_policy()` per tenant, admitted in turn by counter."""

    def __init__(
        self,
        make_policy: Callable[[], QueuePolicy],
        input_weight: float = 1.0,
        output_weight: float = 2.0,
        slots: int | None = None,
    ) -> None:
        """slots: the batch's sequence cap, past which tenants over their share give slots
        back to tenants under it (None: never)."""
        self.make_policy = make_policy
        self.slots = slots
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.policies: dict[Tenant, QueuePolicy] = {}
        self.counters: dict[Tenant, float] = {}
        self._charged: dict[Sequence, int] = {}  # admitted once: output tokens charged so far
        self.name = make_policy().name

    def __len__(self) -> int:
        return sum(len(p) for p in self.policies.values())

    def _policy(self, tenant: Tenant) -> QueuePolicy:
        policy = self.policies.get(tenant)
        if policy is None:
            policy = self.policies[tenant] = self.make_policy()
            self.counters[tenant] = 0.0
        return policy

    def add(self, seq: Sequence, now: float) -> None:
        policy = self._policy(seq.tenant)
        if not len(policy):  # back from idle: no credit for the time away
            waiting = [self.counters[t] for t, p in self.policies.items() if len(p)]
            if waiting:
                self.counters[seq.tenant] = max(self.counters[seq.tenant], min(waiting))
        policy.add(seq, now)

    def requeue(self, seq: Sequence, now: float) -> None:
        self._policy(seq.tenant).requeue(seq, now)

    def remove(self, seq: Sequence) -> None:
        self._charged.pop(seq, None)
        self.policies[seq.tenant].remove(seq)

    def left(self, seq: Sequence, now: float, finished: bool) -> None:
        self._charge_output(seq)
        if seq.status is not SeqStatus.WAITING:  # ended (a preempted one waits again)
            del self._charged[seq]
        self.policies[seq.tenant].left(seq, now, finished)

    def to_squash(self, now: float, room: Room) -> list[Sequence]:
        """Each tenant's policy squashes its own bypassers (a bypass happens within one
        tenant's queue); room counts the victims already chosen for other tenants."""
        victims: list[Sequence] = []

        def beside_chosen(seq: Sequence, leaving: list[Sequence]) -> bool:
            return room(seq, victims + leaving)

        for policy in self.policies.values():
            victims.extend(policy.to_squash(now, beside_chosen))
        if self.slots is not None:
            victims.extend(self._over_share(room, victims))
        return victims

    def _over_share(self, room: Room, chosen: list[Sequence]) -> list[Sequence]:
        """Running requests of tenants over their share of a full batch, preempted so that
        waiting tenants under their share start now (see the module docstring)."""
        assert self.slots is not None
        self._charge_running()
        running: dict[Tenant, list[Sequence]] = {}
        for seq in self._charged:  # in order of first admission
            if seq.status is SeqStatus.RUNNING and seq not in chosen:
                running.setdefault(seq.tenant, []).append(seq)
        busy = {t for t, p in self.policies.items() if len(p)} | running.keys()
        share = self.slots // len(busy) if busy else self.slots
        victims: list[Sequence] = []
        waiting = sorted((t for t, p in self.policies.items() if len(p)), key=self.counters.get)
        for tenant in waiting:
            if sum(map(len, running.values())) < self.slots:
                break  # a free slot: admission gives it by turn
            if len(running.get(tenant, ())) >= share:
                continue
            head = self.policies[tenant].waiting()[0]
            taken: list[Sequence] = []
            while not taken or not room(head, chosen + victims + taken):
                over = [
                    t
                    for t, seqs in running.items()
                    if len(seqs) > share and self.counters[tenant] < self.counters[t]
                ]
                if not over:
                    break
                giver = max(over, key=lambda t: len(running[t]))
                victim = min(reversed(running[giver]), key=lambda s: s.num_computed)
                running[giver].remove(victim)
                taken.append(victim)
            else:
                victims.extend(taken)
                continue
            for victim in taken:  # not enough room even so: nothing preempted for it
                running[victim.tenant].append(victim)
        return victims

    def waiting(self) -> list[Sequence]:
        """Each tenant's waiting requests in its policy's order, merged as admission would
        take them if each cost its prompt tokens."""
        queues = {t: deque(p.waiting()) for t, p in self.policies.items() if len(p)}
        if len(queues) == 1:
            return list(next(iter(queues.values())))
        counters = {t: self.counters[t] for t in queues}
        order: list[Sequence] = []
        while queues:
            tenant = min(queues, key=counters.__getitem__)
            seq = queues[tenant].popleft()
            order.append(seq)
            counters[tenant] += self.input_weight * len(seq.prompt_ids)
            if not queues[tenant]:
                del queues[tenant]
        return order

    def admit(self, now: float, try_admit: TryAdmit) -> None:
        self._charge_running()
        active = [t for t, p in self.policies.items() if len(p)]
        if len(active) == 1:  # alone: exactly its policy's admission
            self.policies[active[0]].admit(now, self._charging(try_admit))
            return
        while active:
            tenant = min(active, key=self.counters.__getitem__)
            admitted, full = self._admit_one(tenant, now, try_admit)
            if full:
                return
            if not admitted:
                active.remove(tenant)
            elif not len(self.policies[tenant]):
                active.remove(tenant)

    def _admit_one(self, tenant: Tenant, now: float, try_admit: TryAdmit) -> tuple[bool, bool]:
        """(admitted one, the batch is full) after giving `tenant`'s policy one admission;
        a second candidate is answered FULL, which every policy takes as "stop here"."""
        admitted = full = False
        charging = self._charging(try_admit)

        def one(seq: Sequence) -> Admit:
            nonlocal admitted, full
            if admitted:
                return Admit.FULL
            result = charging(seq)
            admitted, full = result is Admit.OK, result is Admit.FULL
            return result

        self.policies[tenant].admit(now, one)
        return admitted, full

    def _charging(self, try_admit: TryAdmit) -> TryAdmit:
        """`try_admit` that charges each admitted request's prompt to its tenant (once: a
        preempted request is not charged again for its recompute)."""

        def charge(seq: Sequence) -> Admit:
            result = try_admit(seq)
            if result is Admit.OK and seq not in self._charged:
                self.counters[seq.tenant] += self.input_weight * len(seq.prompt_ids)
                self._charged[seq] = len(seq.output_ids)
            return result

        return charge

    def _charge_running(self) -> None:
        for seq in list(self._charged):
            if seq.status is SeqStatus.RUNNING:
                self._charge_output(seq)

    def _charge_output(self, seq: Sequence) -> None:
        charged = self._charged.get(seq)
        if charged is not None and len(seq.output_ids) > charged:
            self.counters[seq.tenant] += self.output_weight * (len(seq.output_ids) - charged)
            self._charged[seq] = len(seq.output_ids)


def tenant_policies(policy: QueuePolicy) -> list[QueuePolicy]:
    """The policies admitting each tenant's requests (the policy itself unless it is fair)."""
    return list(policy.policies.values()) if isinstance(policy, TenantFair) else [policy]
