# Make targets for the kernel series; the top-level Makefile includes this file.
# They are slow (minutes) and stay out of `make test`; see README.md.
#
#   make kernel-check   apply the series to a fresh linux-source-6.1 tree,
#                       checkpatch --strict, compile with CONFIG_BLK_IO_TAG on/off
#   make kernel-boot    the same, then build a small kernel and boot it under
#                       qemu with an NVMe disk (tag round trip through writeback)

KERNEL_PATCHES_DIR := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))

.PHONY: kernel-check kernel-boot
kernel-check:
	$(KERNEL_PATCHES_DIR)/check

kernel-boot:
	$(KERNEL_PATCHES_DIR)/check --boot
