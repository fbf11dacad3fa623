/* cpu_hog: spins until killed (the bpf tests pin it to the traced workload's CPU). */
int main(void) {
    volatile unsigned long x = 0;
    for (;;) x++;
}
